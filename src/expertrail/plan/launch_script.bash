# Read (as BASH_ENV) by the restricted bash that runs a launch script for expertrail
# (plan/launch_script.py). No program lies on that shell's PATH, so every command the script
# starts arrives here instead, and is recorded, not run. Shells and sbatch get one step more, as
# on the node: the string of `bash -c STRING` (or the file of `bash FILE`), and the script sbatch
# is given (a file, --wrap, or the here-document on its input), run here in a subshell; sbatch's
# script is recorded too, after sbatch, as the command `#SBATCH SCRIPT`.

# A record goes to the descriptor EXPERTRAIL_RECORD_FD as NUL-ended triples (this handler's
# process id, c | w | +, text): c starts a command, w a word, + continues the word. Commands of
# one pipeline are recorded at once by their own processes; each printf is one write of under
# 4 KiB (1,000 characters of at most 4 bytes), which lands whole, so the process id sorts out
# whose piece is whose.
__expertrail_record() {
    local word at
    printf '%s\0c\0\0' "$BASHPID" >&"$EXPERTRAIL_RECORD_FD"
    for word in "$@"; do
        printf '%s\0w\0%s\0' "$BASHPID" "${word:0:1000}" >&"$EXPERTRAIL_RECORD_FD"
        for ((at = 1000; at < ${#word}; at += 1000)); do
            printf '%s\0+\0%s\0' "$BASHPID" "${word:at:1000}" >&"$EXPERTRAIL_RECORD_FD"
        done
    done
}

# A script whose run expertrail reads itself (EXPERTRAIL_HANDED_ON: the ModelZoo's
# sbatch_benchmarking.sh, which writes files as it builds the command) is not followed: it is
# recorded as the command `#HANDED_ON NAME=value ... bash SCRIPT ARGS`: the variables it reads
# (EXPERTRAIL_HANDED_ON_VARIABLES) that are set and not empty, and the script's absolute path.
__expertrail_hand_on() {
    local j=$1 name
    shift
    local -a line=("#HANDED_ON")
    for name in $EXPERTRAIL_HANDED_ON_VARIABLES; do
        [[ -n ${!name-} ]] && line+=("$name=${!name}")     # empty is unset to the scripts' ${NAME:-default}
    done
    __expertrail_record "${line[@]}" bash "$(__expertrail_absolute "${!j}")" "${@:j+1}"
}

command_not_found_handle() {
    __expertrail_record "$@"
    local i j body=""
    for ((i = 1; i <= $#; i++)); do
        case ${!i##*/} in
        bash | sh | dash)
            local string=0
            for ((j = i + 1; j <= $#; j++)); do
                case ${!j} in
                -o | +o | -O | +O) ((j++)) ;;       # an option that takes a value
                --*) ;;
                -*c* | +*c*) string=1 ;;
                -* | +*) ;;
                *) break ;;
                esac
            done
            ((j <= $#)) || return 0
            if ((!string)) && [[ " $EXPERTRAIL_HANDED_ON " == *" ${!j##*/} "* ]]; then
                __expertrail_hand_on "$j" "$@"
                return 0
            fi
            if ((string)); then
                body=${!j}
            else
                [[ -f ${!j} ]] || return 0
                body=$(<"${!j}")
            fi
            (set -- "${@:j+1}"; eval "$body")
            return 0
            ;;
        sbatch)
            for ((j = i + 1; j <= $#; j++)); do
                case ${!j} in
                --wrap=*) body=${!j#--wrap=}; break ;;
                --wrap) ((j++)); body=${!j}; break ;;
                -*) ;;
                *) if [[ -f ${!j} ]]; then body=$(<"${!j}"); break; fi ;;
                esac
            done
            if [[ -z $body && ! -t 0 ]]; then
                IFS= read -r -d "" body || true    # sbatch <<EOF: the script is its input
            fi
            [[ -n $body ]] || return 0
            __expertrail_record "#SBATCH" "$body"          # its directives give the job's size
            (set -- "${@:j+1}"; eval "$body")
            return 0
            ;;
        esac
    done
    return 0
}

# What a script uses to find its own files, which restricted mode refuses (cd, source and . of a
# path) or which are programs (dirname, basename, realpath): done here, on the path's text, as
# `SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); source "$SCRIPT_DIR/common.sh"`
# needs them. The directory a cd goes to is kept in PWD (and read by pwd); the process itself
# stays where it started, so relative paths in the script's own tests ([ -f FILE ]) still read
# from there. A file sourced is read in a function: its `declare`s are local to that read.
__expertrail_absolute() {
    local path=$1 part
    local -a parts=()
    [[ $path == /* ]] || path=$PWD/$path
    local IFS=/
    for part in $path; do
        case $part in
        '' | .) ;;
        ..) ((${#parts[@]})) && unset 'parts[${#parts[@]}-1]' ;;
        *) parts+=("$part") ;;
        esac
    done
    printf '/%s\n' "${parts[*]}"
}
cd() {
    while [[ ${1-} == -[LPe@]* ]]; do shift; done
    PWD=$(__expertrail_absolute "${1:-$HOME}")
    return 0
}
pushd() { cd "$@"; }
popd() { return 0; }
pwd() { printf '%s\n' "$PWD"; }
dirname() {
    local path=${1:-.}
    while [[ $path == */ && $path != / ]]; do path=${path%/}; done
    if [[ $path != */* ]]; then path=.; else path=${path%/*}; fi
    printf '%s\n' "${path:-/}"
}
basename() {
    local path=${1%/}
    path=${path##*/}
    [[ -n ${2-} && $path != "$2" ]] && path=${path%"$2"}
    printf '%s\n' "$path"
}
realpath() {
    local path
    for path in "$@"; do [[ $path == -* ]] || __expertrail_absolute "$path"; done
}
source() {
    local __expertrail_file=$1
    shift
    [[ $__expertrail_file == /* ]] || __expertrail_file=$PWD/$__expertrail_file
    eval "$(<"$__expertrail_file")"
}
. () { source "$@"; }

# Restricted bash makes ENV, SHELL and HISTFILE read-only once this file is read, and a script
# that assigns one stops there; launch scripts use such names for their own values
# (Pai-Megatron-Patch's `ENV=$1`, dsw or dlc). Each is made a reference to a variable of ours,
# which the restriction locks instead, and the references are dropped at the script's first
# command, leaving the names free to it. PATH stays locked: it keeps every program out of reach.
declare -n ENV=__expertrail_ENV SHELL=__expertrail_SHELL HISTFILE=__expertrail_HISTFILE
trap 'unset -n ENV SHELL HISTFILE; trap - DEBUG' DEBUG

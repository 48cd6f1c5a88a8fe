"""The emulated multi-node cluster: real namespaces, real shaped links, real torchrun launches,
and nothing left behind. Skipped, with the reason, where namespaces cannot be made."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from expertrail import cluster as cl
from expertrail.tools.cli import main
from expertrail.errors import ConfigError

PROBE = str(Path(__file__).parent / "cluster_scripts" / "probe.py")


def _can_make_namespaces() -> str | None:
    try:
        cl.check_prerequisites()
    except cl.ClusterError as err:
        return str(err)
    return None


def needs_root(test):
    """A test that brings up an emulated cluster: the ``cluster`` tier, skipped where none can be made."""
    why = _can_make_namespaces()
    return pytest.mark.cluster(pytest.mark.skipif(why is not None, reason=f"no emulated cluster here: {why}")(test))


@pytest.fixture
def no_leftovers():
    """Fail the test if it leaves a namespace, link or record of its own behind."""
    before = set(cl.leftovers()) | set(cl.list_clusters())
    yield
    after = set(cl.leftovers()) | set(cl.list_clusters())
    assert after <= before, f"left behind: {sorted(after - before)}"


@pytest.mark.parametrize("text,expected", [
    ("1gbit", cl.LinkSpec(1e9)), ("200mbit", cl.LinkSpec(2e8)), ("500kbit", cl.LinkSpec(5e5)),
    ("1e9bit", cl.LinkSpec(1e9)), ("2.5Gbit", cl.LinkSpec(2.5e9)),
    ("1gbit,delay=100us,loss=0", cl.LinkSpec(1e9, 1e-4, 0.0)), ("10gbit,loss=1%", cl.LinkSpec(1e10, 0.0, 0.01)),
    ("1gbit,queue=5ms", cl.LinkSpec(1e9, queue=0.005)),
])
def test_link_specs_parse(text, expected):
    assert cl.LinkSpec.parse(text) == expected
    assert cl.LinkSpec.parse(str(expected)) == expected           # the form relaunched nodes are given


@pytest.mark.parametrize("text,message", [
    ("", "is empty"), ("fast", "write a number and a bit unit (bit, kbit, mbit, gbit, tbit), e.g. 1gbit"), ("1gbit,jitter=1ms", "unknown setting 'jitter'"),
    ("1gbit,loss=2", "loss must be in [0, 1)"), ("10kbit", "below 100kbit"), ("1gbit,delay=5", "100us or 1ms"),
    ("1gbit,queue=500us", "queue must be >= 1ms"), ("1gbit,queue=5", "queue '5'"),
    # tc reads bps, kbps, mbps, gbps as BYTES per second: refused, with both readings spelled out
    ("1gbps", "tc reads 'gbps' as bytes per second (8gbit); write 1gbit, or 8gbit if you meant bytes"),
    ("100mbps,loss=1%", "tc reads 'mbps' as bytes per second (800mbit); write 100mbit, or 800mbit if you meant bytes"),
    ("1000", "write a number and a bit unit"), ("1gb", "write a number and a bit unit"),
    ("1..2gbit", "write a number and a bit unit"), ("1gbit,loss=x%", "loss 'x' is not a number"),
])
def test_bad_link_specs_say_what_to_write(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cl.LinkSpec.parse(text)


@pytest.mark.parametrize("argv", [["bench", "--nodes", "2", "--inter-link", "1gbps"],
                                  ["train", "--nodes", "2", "--inter-link", "1gbps"],
                                  ["cluster", "up", "--inter-link", "1gbps"],
                                  ["cluster", "run", "--inter-link", "1gbps", "--", PROBE]])
def test_a_byte_rate_stops_the_command_while_its_arguments_are_parsed(argv, monkeypatch, capsys):
    monkeypatch.setattr(cl, "check_prerequisites", lambda: pytest.fail("a cluster was being brought up"))
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert ("error: argument --inter-link: rate '1gbps': tc reads 'gbps' as bytes per second (8gbit); write 1gbit, "
            "or 8gbit if you meant bytes") in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["bench", "--nodes", "2", "--ranks-per-node", "3", "--experts", "16"],
     "bench: --experts 16 must be a multiple of the 6 ranks (--nodes 2 x --ranks-per-node 3): every rank holds the "
     "same number of experts; give --experts 18 (or 12)"),
    (["bench", "--nodes", "2", "--ranks-per-node", "2", "--domain-size", "3"],
     "bench: --domain-size 3 must divide the 4 ranks (--nodes 2 x --ranks-per-node 2): give one of 1, 2, 4"),
    (["bench", "--nodes", "2", "--experts", "8", "--topk", "9"], "bench: --topk 9 must be between 1 and --experts 8"),
    (["bench", "--nodes", "2", "--routing", "zipf:hot"], "bench: --routing 'zipf:hot': write zipf:<alpha>"),
    (["bench", "--decode", "--nodes", "2", "--experts", "6"], "bench: --experts 6 must be a multiple of the 4 ranks"),
    (["train", "--nodes", "2", "--ranks-per-node", "3"], "train: --experts 8 must be a multiple of the 6 ranks"),
    (["train", "--nodes", "2", "--hidden", "30"], "train: --hidden 30 must be a positive multiple of the model's 4"),
    (["cluster", "run", "--nodes", "2", "--ranks-per-node", "3", "--", "-m", "expertrail", "bench", "--experts", "16"],
     "cluster: -m expertrail bench: --experts 16 must be a multiple of the 6 ranks (--nodes 2 x --ranks-per-node 3)"),
    (["cluster", "run", "--nodes", "1", "--ranks-per-node", "3", "--", "-m", "expertrail", "bench"],
     "cluster: -m expertrail bench: --domain-size 2 must divide the 3 ranks (--nodes 1 x --ranks-per-node 3): give "
     "one of 1, 3 (bench's default; `bench --nodes` sets it to the ranks per node, here give --domain-size 3)"),
    (["cluster", "run", "--", "no_such_script.py"], "cluster: no_such_script.py: no such script"),
    (["cluster", "run", "--", "-m", "no_such_module"], "cluster: -m no_such_module: no module 'no_such_module'"),
    (["cluster", "run", "--timeout", "0", "--", sys.executable], "cluster: --timeout 0: give the seconds"),
])
def test_sizes_that_cannot_run_are_refused_in_one_line_before_anything_starts(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(cl, "check_prerequisites", lambda: pytest.fail("a cluster was being brought up"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"expertrail {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("nodes", [0, 251])
def test_node_count_out_of_range_is_refused(nodes):
    with pytest.raises(ConfigError, match=r"must be in 1\.\.250"):
        cl.Cluster(nodes, cl.LinkSpec.parse("1gbit"))


@pytest.mark.parametrize("cores,nodes,shares", [(range(8), 2, [[0, 1, 2, 3], [4, 5, 6, 7]]), (range(5), 2, [[0, 1], [2, 3]]),
                                                ([3, 5], 2, [[3], [5]]), (range(2), 4, None)])
def test_each_node_gets_its_own_share_of_the_cores(cores, nodes, shares, monkeypatch):
    monkeypatch.setattr(cl.os, "sched_getaffinity", lambda pid: set(cores))
    c = cl.Cluster(nodes, cl.LinkSpec.parse("1gbit"))
    assert c.node_cores() == shares
    if shares:
        c.netns, c.address, c.prefix = [f"n{i}" for i in range(nodes)], [f"10.0.0.{i}" for i in range(nodes)], "er0000"
        for share, argv in zip(shares, c.torchrun_commands(["s.py"], 1)):
            assert argv[4:7] == ["taskset", "-c", ",".join(map(str, share))]


def test_missing_iproute2_is_named(monkeypatch):
    monkeypatch.setattr(cl.shutil, "which", lambda tool: None)
    with pytest.raises(cl.ClusterError, match=r"needs iproute2 \(ip, tc not found\)"):
        cl.check_prerequisites()


@needs_root
def test_two_nodes_launch_like_a_multinode_job_and_shape_the_inter_node_link(no_leftovers):
    with cl.Cluster(2, cl.LinkSpec.parse("100mbit,queue=20ms")) as c:
        results = c.run([PROBE], ranks_per_node=2, timeout=240, capture=True)
        assert c.prefix in cl.list_clusters() and len(cl.leftovers()) >= 5
        shaper = subprocess.run(["tc", "qdisc", "show", "dev", f"{c.prefix}b1"], capture_output=True, text=True).stdout
        assert "tbf" in shaper and "lat 20ms" in shaper, shaper            # the queue setting reached tc
    rows = [json.loads(line) for r in results for line in r.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]
    for r in rows:   # torchrun's multi-node numbering: node i holds ranks [2i, 2i+2), LOCAL_WORLD_SIZE 2
        assert r["world"] == 4 and r["local_world"] == 2 and r["domain_size"] == 2 and r["domain"] == r["rank"] // 2
        assert r["y_finite"] and r["node"] == c.prefix
    for node, result in enumerate(results):
        node_ranks = {json.loads(line)["rank"] for line in result.stdout.splitlines() if line.startswith("{")}
        assert node_ranks == {2 * node, 2 * node + 1}
    # each node runs on its own share of the machine's cores, and torch's threads fit in it
    shares = c.node_cores()
    if shares is not None:
        assert not set(shares[0]) & set(shares[1])
        for r in rows:
            assert r["cores"] == shares[r["rank"] // 2] and 1 <= r["threads"] <= len(r["cores"]), r
    # Each rank sends half of its 4 MiB to the other node, and two ranks share a node's link:
    # 4 MiB per direction at 100 Mbit/s is 0.34 s (the token bucket's burst takes a little off),
    # while the same exchange inside a node takes milliseconds.
    line_rate_s = 2 * (4096 * 256 * 4 // 2) * 8 / 100e6
    intra = max(r["intra_s"] for r in rows)
    inter = min(r["inter_s"] for r in rows)
    assert inter > 0.6 * line_rate_s and inter > 5 * intra, (line_rate_s, rows)


@needs_root
def test_a_failing_node_stops_the_run_and_the_cluster_still_goes(no_leftovers):
    with pytest.raises(cl.ClusterError, match=r"node 1 of cluster er[0-9a-f]{4} exited with status"):
        with cl.Cluster(2, cl.LinkSpec.parse("1gbit")) as c:
            c.run([PROBE, "fail"], ranks_per_node=1, timeout=120, capture=True)


@needs_root
def test_two_clusters_at_once_do_not_clash(no_leftovers):
    with cl.Cluster(1, cl.LinkSpec.parse("1gbit")) as a, cl.Cluster(2, cl.LinkSpec.parse("1gbit")) as b:
        assert a.prefix != b.prefix and a.subnet != b.subnet
        assert not set(a.netns) & set(b.netns)
        assert {a.prefix, b.prefix} <= set(cl.list_clusters())
    assert not {a.prefix, b.prefix} & set(cl.list_clusters())


# The owner handles Ctrl-C as an interactive Python does, also when the suite runs as a
# background job (whose children start with SIGINT ignored).
OWNER = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from expertrail import cluster as cl
    c = cl.Cluster(2, cl.LinkSpec.parse("1gbit")).up()
    print(c.prefix, flush=True)
    time.sleep(120)
""")


@needs_root
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_killed_owner_leaves_nothing_behind(how, no_leftovers):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    prefix = owner.stdout.readline().strip()
    assert prefix in cl.list_clusters()
    owner.send_signal(getattr(signal, how))
    owner.wait(timeout=30)
    if how == "SIGKILL":          # no handler runs: the next cluster (or `cluster down`) removes it
        assert prefix in cl.list_clusters()
        assert prefix in cl.remove_stale_clusters()
    assert prefix not in cl.list_clusters()
    assert not [n for n in cl.leftovers() if n.startswith(prefix)]


# Each rank says it is running, then waits to be interrupted.
WAITER = "import os, sys, time\nsys.stdout.write(f\"ready {os.environ['RANK']}\\n\")\nsys.stdout.flush()\ntime.sleep(120)\n"


def _interrupt_when_ready(argv: list, ranks: int) -> subprocess.CompletedProcess:
    """Run ``expertrail ARGV`` as a terminal would (SIGINT handled by Python, in a process group
    of its own), press Ctrl-C (SIGINT to the group) once ``ranks`` ranks run; its result."""
    run = subprocess.Popen([sys.executable, "-m", "expertrail", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ready = 0
    while ready < ranks:
        line = run.stdout.readline()
        assert line, run.communicate(timeout=60)         # it ended before its ranks ran
        ready += line.startswith("ready")
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


@needs_root
@pytest.mark.parametrize("named", [False, True])
def test_ctrl_c_on_cluster_run_prints_one_line_and_exits_130(named, tmp_path, capsys, no_leftovers):
    """Ctrl-C: no KeyboardInterrupt traceback, no torchrun SignalException; the run's own cluster
    is torn down, a named one (`cluster up`) stays up with nothing of the run left in it."""
    script = tmp_path / "wait.py"
    script.write_text(WAITER)
    prefix = None
    if named:
        assert main(["cluster", "up", "--nodes", "2"]) == 0
        prefix = capsys.readouterr().out.split(":")[0]
    try:
        where = ["--name", prefix] if named else ["--nodes", "2"]
        done = _interrupt_when_ready(["cluster", "run", *where, "--ranks-per-node", "1", "--", str(script)], 2)
        assert done.returncode == 130, done.stderr
        assert "Traceback" not in done.stderr and "SignalException" not in done.stderr, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        if named:
            assert last == (f"expertrail: interrupted; the command's ranks were stopped; cluster {prefix} is still up "
                            f"(`expertrail cluster down {prefix}` removes it)")
            assert prefix in cl.list_clusters()
            for ns in cl.Cluster.attach(prefix).netns:     # launchers and ranks all ended
                assert subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout == ""
        else:
            own = re.search(r"cluster (er[0-9a-f]{4}): 2 nodes", done.stderr).group(1)
            assert last == f"expertrail: interrupted; cluster {own} torn down"
            assert own not in cl.list_clusters()
    finally:
        if named:
            assert main(["cluster", "down", prefix]) == 0


@needs_root
def test_cli_up_status_run_down(capsys, no_leftovers):
    assert main(["cluster", "up", "--nodes", "2", "--inter-link", "1gbit"]) == 0
    prefix = capsys.readouterr().out.split(":")[0]
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"{prefix}_hello.py"
    try:
        assert main(["cluster", "status"]) == 0
        assert f"{prefix}: 2 nodes" in capsys.readouterr().out
        # one write per line: two nodes share the pipe, and unbuffered print writes piece by piece
        script.write_text("import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\")\n")
        rc = subprocess.run([sys.executable, "-m", "expertrail", "cluster", "run", "--name", prefix,
                             "--ranks-per-node", "1", "--", str(script)], capture_output=True, text=True,
                            timeout=120)
        assert rc.returncode == 0, rc.stderr
        assert sorted(line for line in rc.stdout.splitlines() if line.startswith("rank")) == \
            ["rank 0 of 2", "rank 1 of 2"]
    finally:
        script.unlink(missing_ok=True)
        assert main(["cluster", "down", prefix]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["cluster", "down"]) == 2
    assert "give --all" in capsys.readouterr().err


@needs_root
def test_bench_on_two_nodes_measures_links_predicts_and_counts_bytes_like_the_planner(tmp_path, no_leftovers):
    report, hw_path = tmp_path / "bench.json", tmp_path / "emulated.yaml"
    done = subprocess.run([sys.executable, "-m", "expertrail", "bench", "--nodes", "2", "--ranks-per-node", "2",
                           "--inter-link", "1gbit", "--tokens", "64", "--hidden", "32", "--iters", "1",
                           "--json", str(report), "--emit-hardware", str(hw_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "links emulated: 2 nodes x 2 ranks" in done.stdout and "tbf to 1gbit" in done.stdout
    data = json.loads(report.read_text())
    assert data["config"]["world"] == 4 and data["config"]["domain_size"] == 2
    assert data["emulated"]["inter_link"] == "1gbit"
    assert set(data["links"]) == {"intra", "inter"} and all(v["GBps"] > 0 for v in data["links"].values())
    for name, r in data["results"].items():
        assert r["check"] == "passed" and r["predicted_total_s"] > 0, name
        assert r["planner_bytes_match"], (name, r["planner_bytes"], r["dispatch_bytes"])
        assert r["planner_rows"] == r["dispatch_rows"], name
    from expertrail.plan.catalog import load_hardware
    hw = load_hardware(str(hw_path))
    assert hw.measured and hw.domain_size == 2 and hw.nic_GBps == round(data["links"]["inter"]["GBps"], 4)
    local = data["local_passes"]
    assert local["copy_GBps"] > 0 and local["reduce_GBps"] > 0 and "measured local passes: copy" in done.stdout
    assert hw.local_copy_GBps == round(local["copy_GBps"], 3) and hw.local_reduce_GBps == round(local["reduce_GBps"], 3)


@needs_root
def test_bench_on_four_nodes_of_two_is_correct(no_leftovers):
    done = subprocess.run([sys.executable, "-m", "expertrail", "bench", "--nodes", "4", "--ranks-per-node", "2",
                           "--tokens", "16", "--hidden", "16", "--iters", "1", "--warmup", "1"],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    table = [line.split() for line in done.stdout.splitlines() if line.split()[:1] and line.split()[0] in
             ("allgather", "alltoall", "dedup", "hierarchical") and line.split()[-1] in ("passed", "FAILED")]
    assert len(table) == 4 and all(row[-1] == "passed" for row in table), done.stdout
    assert "world 8, domain 2" in done.stdout


@needs_root
def test_a_node_link_going_down_mid_run_raises_collective_error_everywhere(tmp_path, no_leftovers):
    """`ip link set ... down` on node 1's link while ranks dispatch in a loop: every rank raises
    CollectiveError within 2x the group timeout, nothing hangs, and the cluster goes."""
    timeout = 5.0
    ready, down = tmp_path / "ready", tmp_path / "down"
    script = str(Path(__file__).parent / "cluster_scripts" / "link_down.py")
    with cl.Cluster(2, cl.LinkSpec.parse("1gbit")) as c:
        launchers = [subprocess.Popen(argv, env=c.node_env(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True)
                     for i, argv in enumerate(c.torchrun_commands([script, str(timeout), str(ready), str(down)], 2))]
        try:
            start = time.monotonic()
            while not ready.exists():
                assert time.monotonic() - start < 120, "the ranks never got going"
                assert all(p.poll() is None for p in launchers), [p.communicate() for p in launchers]
                time.sleep(0.1)
            down.write_text(repr(time.time()))
            subprocess.run(["ip", "link", "set", f"{c.prefix}b1", "down"], check=True)
            reports = [tmp_path / f"rank{r}.json" for r in range(4)]
            while not all(f.exists() for f in reports) and time.monotonic() - start < 240:
                time.sleep(0.2)
        finally:
            for p in launchers:           # their agents wait for each other across the dead link
                cl._kill_session(p)
    rows = [json.loads(f.read_text()) for f in reports if f.exists()]
    print("link down:", [(r["rank"], r["error"], round(r["after_down_s"], 2)) for r in rows])
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], rows
    for r in rows:
        assert r["error"] == "CollectiveError", r
        assert r["after_down_s"] <= 2 * timeout, r


@needs_root
def test_one_percent_loss_leaves_results_bitwise_identical(tmp_path, no_leftovers):
    if cl.shutil.which("nft") is None:
        pytest.skip("packet loss needs nftables (apt-get install nftables); ./run.sh test installs it as root")
    script = str(Path(__file__).parent / "cluster_scripts" / "digest.py")
    digests = {}
    for spec in ("1gbit", "1gbit,loss=1%"):
        out = tmp_path / spec.replace(",", "_").replace("%", "")
        out.mkdir()
        with cl.Cluster(2, cl.LinkSpec.parse(spec)) as c:
            c.run([script, str(out)], ranks_per_node=2, timeout=240, capture=True)
            if "loss" in spec:       # the drop rule is in force, and dropped packets
                rules = subprocess.run(["nft", "list", "table", "netdev", f"{c.prefix}loss"], capture_output=True,
                                       text=True).stdout
                dropped = re.search(r"numgen random mod 1000000 < 10000 counter packets (\d+)", rules)
                assert dropped and int(dropped.group(1)) > 0, rules
        digests[spec] = [(out / f"rank{r}.sha").read_text() for r in range(4)]
    assert digests["1gbit"] == digests["1gbit,loss=1%"]
    assert len(set(digests["1gbit"])) == 4          # ranks differ: the digest covers their own data


@needs_root
def test_control_exchanges_do_not_wait_behind_rows_in_flight(tmp_path, no_leftovers):
    """A dispatch's counts and header travel on a gloo group of their own: posted while 32 MiB
    of rows cross a 1 Gbit/s link (268 ms at line rate), they land in well under half the rows'
    time (on the EP group's sockets they would land only after them)."""
    script = str(Path(__file__).parent / "cluster_scripts" / "control_beside_rows.py")
    with cl.Cluster(2, cl.LinkSpec.parse("1gbit")) as c:
        c.run([script, str(tmp_path), "32"], ranks_per_node=1, timeout=240, capture=True)
    report = json.loads((tmp_path / "control.json").read_text())
    assert report["own_group"], report
    assert report["control_s"] < report["rows_s"] / 2, report


@needs_root
def test_a_delay_without_netem_says_what_is_missing(no_leftovers):
    if cl.kernel_has_qdisc("netem"):
        pytest.skip("this kernel has netem")
    with pytest.raises(cl.ClusterError, match="a delay needs tc's netem qdisc, which this kernel does not have"):
        cl.Cluster(2, cl.LinkSpec.parse("1gbit,delay=100us")).up()

"""How ranks talk: the EP process groups and their placement of experts (`topology`), the
exchanges that move rows between them (`transport`), and the schedule that lets micro-batches
take turns while exchanges are in flight (`schedule`). Part of the engine: imports only
`errors` and `names` from outside it."""

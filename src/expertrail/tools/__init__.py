"""The `expertrail` command (`cli`) and what its commands run: the dispatch bench (`bench`,
`bench_decode`), the training comparison (`train`), the serving loop and its simulation
(`serving`, `serve_sim`), workloads and command configs (`workload`, `configs`)."""

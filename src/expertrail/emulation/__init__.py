"""A multi-node cluster emulated on one machine (`cluster`: network namespaces joined by
shaped links, torchrun per node), link measurement (`links`), and pools of local gloo ranks
(`launch`) for tests, the command line and examples. See docs/emulated-cluster.md."""

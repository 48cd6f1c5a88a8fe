"""The MoE model layer on top of the engine: the router (`router`), grouped experts
(`experts`), the expert-parallel layer (`layer.MoELayer`), Hugging Face transformers blocks
made expert parallel (`hf`), and the check that the weights every rank replicates are the
same (`replicated`)."""

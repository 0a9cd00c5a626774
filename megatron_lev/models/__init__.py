"""The Leviathan decoder and its baselines (`lev`, `tied`, `untied`, `factorized`) on megatron-core's TP layers.

  config.py         LeviathanConfig (megatron-core's TransformerConfig + our fields), from a YAML section
  layers.py         init seeds, RoPE, RMSNorm, the input side (LEV | vocab table | factorised table),
                    linears, the head
  transformer.py    one decoder layer: RoPE self-attention (GQA) + SwiGLU MLP; per-layer torch.compile
  cross_entropy.py  float32 vocab-parallel cross entropy and the masked-mean loss
  decoder.py        LeviathanModel: embedding -> layers -> norm -> head (the weight / TP-split table)
  pipeline.py       the same model as a DeepSpeed PipelineModule (PP > 1)
  shape.py          the sizes without torch: vocab padding, MLP width, the model fields, count_parameters,
                    ModelShape (what experiments/cluster_plan.py measures)
  param_count.py    parameter breakdowns, the isoparametric planner, the factorised rank planner
  settings.py       the model settings: field <-> Megatron-LM flag <-> Hugging Face key (one table)
  gpt_lev.py        megatron-core's GPTModel with LEV as its input side; mcore_args.py its names
"""

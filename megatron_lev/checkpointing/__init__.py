"""Checkpoints: saving and resuming training, reading any layout, loading files safely.

  catalog.py     the --save folder: tags, completion markers, `latest`, which checkpoint to resume
  save.py        save a DeepSpeed engine's checkpoint with our bookkeeping, fsynced, then `latest`
  space.py       a checkpoint's size (saved, estimated), the free-space check before a save
  load.py        resume one into a DeepSpeed engine (weights_only checks first, RNG streams)
  universal.py   resume at another TP/PP/DP/ZeRO layout through DeepSpeed's universal checkpoint
  layout.py      how each parameter is split over TP ranks; the full (layout-free) state dict
  convert.py     read a checkpoint of any TP/PP/ZeRO layout into a full state dict
  safe_load.py   torch.load(weights_only=True) with an allow-list; DeepSpeed's loads made safe
"""

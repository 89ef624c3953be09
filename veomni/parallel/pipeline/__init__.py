"""Pipeline parallelism: the stage layout arithmetic, cutting a model into stages, the schedule, the
point-to-point transfers, tied weights across stages and per-stage optimizers. Modality code plugs in
through ``stage_hooks.StageHooks``; nothing here imports it."""

"""What a run costs: the analytic cost model (time and memory per level: ``costmodel``), the GPU kinds it
prices (``hardware``) and their peaks (``gpu_peaks``), what a level's packs hold (``sample_packs``), the memory
report of a config's levels (``memory``: ``python -m lit_hbp.cost.memory``), a run's settings as every tool
reads them (``run_settings``) and a training config read for the tools (``config``)."""

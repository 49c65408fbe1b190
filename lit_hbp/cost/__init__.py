"""What a run costs: the analytic cost model (time and memory per level: ``costmodel``), the memory
report of a config's levels (``memory``: ``python -m lit_hbp.cost.memory``), the GPUs' peaks
(``gpu_peaks``), a run's settings as every tool reads them (``run_settings``) and a training config read
for the tools (``config``)."""

"""How a Hugging Face model computes a pack: building it (``build``), ``prepare_model`` and the packed
call (``causal_lm``, ``packed_call``, ``calls``), its attention (``attention``: the varlen kernels), its
stateful token mixers run document by document (``mixers``), the loss (``loss``), MLP tiles and host
offload of the checkpointed inputs (``tiling``, ``offload``), a vision-language model's image encoding
(``vision``, and ``sp_media`` under sequence parallelism), the model checks before a run (``checks``) and
the self-check (``selfcheck``). The public functions are ``lit_hbp``'s (``prepare_model``,
``packed_loss``, ...)."""

"""``AccumBPTT``: :class:`brainpy.BPTT` with gradient accumulation, and what it is made of.

``_accum_bptt``: the class; ``_fit_loop``: the epochs of ``fit``; ``_feed``: each batch sent to the device while
the step before it runs; ``_step``: one batch's compiled step (on a mesh: ``_sharded``); ``_window``:
accumulation across batches; ``_update``: clipping and the non-finite guard;
``_plans``: plans, placement and compilation per batch size; ``_model_loss``: the model's predictions and
loss; ``_coupled_loss``: the first-batch check that the loss is a mean over samples; ``_arguments``: argument
checks and their errors; ``_report``: the metric history and report lines.
"""

from ._accum_bptt import AccumBPTT as AccumBPTT

__all__ = ['AccumBPTT']

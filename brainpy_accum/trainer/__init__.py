"""``AccumBPTT``: :class:`brainpy.BPTT` with gradient accumulation, and what it is made of.

``_accum_bptt``: the class, a thin trainer that composes the parts below; ``_fit_loop``: ``FitLoop``, one
``fit`` call; ``_pass``: one pass over the data, and the metric history and report lines; ``_fit_check``: when the
first-batch check starts and finishes; ``_feed``: each batch, or piece of one, sent to the device while the step
before it runs; ``_compiled_steps``: the steps it runs, jitted or compiled ahead of time for the planner;
``_step``: one batch's step (sums, settled, clipped, guarded; on a mesh: :func:`brainpy_accum.core._mesh.on_mesh`);
``_window``: accumulation across batches; ``_model_loss``: the model's predictions and loss over bp.BPTT's own
functions; ``_coupled_loss``: the first-batch check that the loss is a mean over samples (what it computes:
``_random_outputs``); ``_arguments``: argument checks and their errors. The memory planner is
:mod:`brainpy_accum.memory`'s.
"""

from ._accum_bptt import AccumBPTT as AccumBPTT

__all__ = ['AccumBPTT']

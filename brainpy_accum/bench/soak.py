"""``python -m brainpy_accum.bench.soak``: resident memory and compilations over a long, checkpointed run.

Trains a small rate RNN with ``AccumBPTT`` through :meth:`fit` for 20,000
steps (random batches: this checks the process, not learning), writing a
checkpoint every 500 updates; in the middle of an epoch the run is
interrupted (a KeyboardInterrupt from the data, as Ctrl-C would be) and the
same ``fit`` call resumes it from the checkpoint. The process's resident
memory is sampled every 100 steps; after warm-up it must stay flat (growth
< 2% from the end of warm-up to the last step), with one XLA compilation of
the train step per batch shape, resume included.
"""

import argparse
import os
import resource
import tempfile
from typing import Optional, Sequence

import brainpy as bp

from ..trainer import AccumBPTT
from .workloads import Shape, make_batch, make_brainpy_model

TARGET = 0.02


def resident_bytes() -> int:
  """Current resident set size of this process (Linux ``/proc``; peak RSS elsewhere)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * resource.getpagesize()
  except OSError:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _interrupting(batches, at_step: int):
  """The batches each epoch, raising KeyboardInterrupt once, when step ``at_step`` is fetched."""
  state = {'step': 0, 'interrupted': False}

  def data():
    for batch in batches:
      state['step'] += 1
      if state['step'] == at_step and not state['interrupted']:
        state['interrupted'] = True
        raise KeyboardInterrupt
      yield batch

  return data, state


def main(argv: Optional[Sequence[str]] = None) -> float:
  """Run the soak; return the relative growth of resident memory after warm-up."""
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.soak', description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=20000)
  parser.add_argument('--warmup', type=int, default=1000)
  parser.add_argument('--every', type=int, default=100, help='steps per epoch and between memory samples')
  parser.add_argument('--checkpoint-every', type=int, default=500)
  parser.add_argument('--out', default=None, help='write the table and verdict to this markdown file too')
  parser.add_argument('--resume-at', type=int, default=None, help='step at which the run is interrupted and '
                      'resumed (default: the middle of the epoch in the middle of the run)')
  args = parser.parse_args(argv)
  resume_at = args.resume_at or (args.steps // 2 + args.every // 2 + 1)
  shape = Shape(batch=64, time=20, hidden=64, inputs=16)
  batches = [make_batch(shape, seed=i) for i in range(args.every)]
  batches[-1] = tuple(a[:-7] for a in batches[-1])  # a short last batch, as real epochs have
  trainer = AccumBPTT(make_brainpy_model('rnn', shape), bp.losses.mean_squared_error, num_micro_batch=4,
                      progress_bar=False)
  samples = {}
  record = lambda idx, metrics, phase: samples.setdefault(idx, resident_bytes())
  data, state = _interrupting(batches, resume_at)
  checkpoint = os.path.join(tempfile.mkdtemp(prefix='brainpy_accum_soak_'), 'soak.ckpt')
  run = dict(num_epoch=args.steps // args.every, num_report=args.every, fun_after_report=record,
             checkpoint=checkpoint, checkpoint_every=args.checkpoint_every)
  try:
    trainer.fit(data, **run)
  except KeyboardInterrupt:
    print(f'interrupted at step {resume_at}; resuming from the checkpoint of step '
          f'{(resume_at - 1) // args.checkpoint_every * args.checkpoint_every} or later')
  if state['interrupted']:
    trainer.fit(data, **run)
  growth = samples[args.steps] / samples[args.warmup] - 1.
  verdict = 'met' if growth < TARGET else 'MISSED'
  summary = (f'{len(trainer.train_losses)} report windows of {args.every} steps; resident memory from step '
             f'{args.warmup} to {args.steps}: {100 * growth:+.2f}% (target < {100 * TARGET:.0f}%: {verdict}); XLA '
             f'compilations of the train step: {trainer.compilations["fit"]} (2 batch shapes); checkpoint every '
             f'{args.checkpoint_every} updates, interrupted and resumed at step '
             f'{resume_at if state["interrupted"] else "(not interrupted)"}')
  table = ['| step | resident MiB |', '|---|---|'] + [f'| {step} | {size / 2 ** 20:.1f} |'
                                                      for step, size in samples.items() if step % 1000 == 0 or step == args.warmup]
  print('\n'.join(table) + '\n' + summary)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(f'# Soak\n\nMade by `python -m brainpy_accum.bench.soak --out {args.out}`: {__doc__.split(chr(10), 1)[1]}\n'
              f'**{summary}.**\n\n' + '\n'.join(table) + '\n')
  return growth


if __name__ == '__main__':
  main()

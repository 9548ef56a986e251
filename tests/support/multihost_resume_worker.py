"""One process of the two-process checkpoint check: ``python multihost_resume_worker.py ID PORT CKPT OUT STOP``.

Two processes (2 simulated CPU devices each, joined over 127.0.0.1) train ``AccumBPTT`` on a mesh of all
four devices with ``accumulate_steps=2``, so that the running sums of an update live one row per device,
on both processes. With ``STOP`` > 0 the data raises KeyboardInterrupt in both processes while fetching
batch ``STOP`` of the first epoch (``STOP`` = 4: batch 2 is in the window): ``fit`` writes its final checkpoint (process 0 alone, after
gathering the rows from both) and the processes end. Run again with ``STOP`` = 0 and the same ``CKPT``,
fresh processes resume from it and save their parameters and losses to ``OUT/process_<id>.npz``.
"""

import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'

import jax  # noqa: E402

jax.config.update('jax_cpu_collectives_implementation', 'gloo')


def main(process_id: int, port: int, checkpoint: str, out_dir: str, stop: int) -> None:
  jax.distributed.initialize(coordinator_address=f'127.0.0.1:{port}', num_processes=2, process_id=process_id,
                             initialization_timeout=120)
  import numpy as np
  from jax.sharding import Mesh

  from multihost_data import RESUME_BATCHES, NUM_EPOCH, make_resume_trainer
  from helpers import params_of

  trainer = make_resume_trainer(Mesh(np.array(jax.devices()), ('batch',)))

  def data():
    for i, batch in enumerate(RESUME_BATCHES):
      if stop and i == stop:
        raise KeyboardInterrupt
      yield batch

  try:
    trainer.fit(data, num_epoch=NUM_EPOCH, checkpoint=checkpoint)
  except KeyboardInterrupt:
    print(f'process {process_id}: interrupted; checkpoint written: {os.path.exists(checkpoint)}', flush=True)
  else:
    np.savez(os.path.join(out_dir, f'process_{process_id}.npz'), *params_of(trainer.target),
             losses=trainer.train_losses)
  jax.distributed.shutdown()


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))

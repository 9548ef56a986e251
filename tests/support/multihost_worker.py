"""One process of a two-process run over the loopback address (started by ``test_mesh.py``).

``python multihost_worker.py PROCESS_ID PORT OUT_DIR``: joins the run with
:func:`jax.distributed.initialize` and JAX's CPU collectives (gloo), trains
AccumBPTT on a mesh of all processes' devices (2 simulated CPU devices each)
and saves its parameters and losses to ``OUT_DIR/process_<id>.npz``.
"""

import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'

import jax  # noqa: E402

jax.config.update('jax_cpu_collectives_implementation', 'gloo')


def main(process_id: int, port: int, out_dir: str) -> None:
  jax.distributed.initialize(coordinator_address=f'127.0.0.1:{port}', num_processes=2, process_id=process_id,
                             initialization_timeout=120)
  import brainpy as bp
  import numpy as np
  from jax.sharding import Mesh

  from brainpy_accum import AccumBPTT
  from multihost_data import BATCHES, NUM_EPOCH, make_trainer_kwargs
  from helpers import make_model, params_of

  mesh = Mesh(np.array(jax.devices()), ('batch',))  # 4 devices: 2 in each process
  model = make_model('rnn')
  trainer = AccumBPTT(model, bp.losses.mean_squared_error, mesh=mesh, **make_trainer_kwargs())
  trainer.fit(BATCHES, num_epoch=NUM_EPOCH)
  np.savez(os.path.join(out_dir, f'process_{process_id}.npz'), *params_of(model), losses=trainer.train_losses,
           devices=np.array([jax.device_count(), jax.process_count()]))
  jax.distributed.shutdown()


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

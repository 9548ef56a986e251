"""``python multihost_resume.py OUT_DIR``: the two-process checkpoint check, both halves in sequence.

Two processes train until both are interrupted mid-window and process 0 writes the checkpoint; then two
fresh processes resume from it and finish. Exits non-zero if a half fails; ``test_mesh.py`` compares
``OUT_DIR/process_<id>.npz`` with a one-process run that was never interrupted.
"""

import os
import pathlib
import socket
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
STOP = 4


def _port() -> str:
  with socket.socket() as probe:
    probe.bind(('127.0.0.1', 0))
    return str(probe.getsockname()[1])


def _pair(checkpoint: str, out_dir: str, stop: int) -> None:
  port = _port()
  processes = [subprocess.Popen([sys.executable, str(HERE / 'multihost_resume_worker.py'), str(i), port, checkpoint,
                                 out_dir, str(stop)]) for i in range(2)]
  codes = [p.wait(timeout=600) for p in processes]
  if any(codes):
    sys.exit(f'two-process run (stop={stop}) failed: exit codes {codes}')


def main(out_dir: str) -> None:
  checkpoint = os.path.join(out_dir, 'run.ckpt')
  _pair(checkpoint, out_dir, STOP)
  leftovers = sorted(p for p in os.listdir(out_dir) if p.startswith('run.ckpt'))
  if leftovers != ['run.ckpt']:
    sys.exit(f'after the interrupted half, expected only run.ckpt, found {leftovers}')
  _pair(checkpoint, out_dir, 0)


if __name__ == '__main__':
  main(sys.argv[1])

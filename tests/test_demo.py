"""The main job tells a user what to install when an optional dependency is missing, before any work."""

import importlib.util

import pytest

from brainpy_accum import demo


def _without(monkeypatch, missing):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == missing else find_spec(name, *a))


def test_demo_without_scikit_learn_names_the_install_command(monkeypatch):
  _without(monkeypatch, 'sklearn')
  with pytest.raises(SystemExit, match=r'(?s)scikit-learn, which is not installed.*pip install "brainpy-accum\[demo\]"'):
    demo.main(['--epochs', '0'])


def test_demo_without_matplotlib_trains_and_says_how_to_get_the_plot(monkeypatch, capsys, tmp_path):
  _without(monkeypatch, 'matplotlib')
  plot = tmp_path / 'curves.png'
  demo.main(['--epochs', '0', '--plot', str(plot)])
  assert 'matplotlib is not installed, so no plot will be written' in capsys.readouterr().out
  assert not plot.exists()

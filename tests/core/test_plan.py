"""The micro-batch plan: sizes cover the batch, bounded count and size."""

import math

import pytest
from hypothesis import given, strategies as st

from brainpy_accum import plan_micro_batches


@given(batch_size=st.integers(1, 500), num_micro_batch=st.integers(1, 64))
def test_num_micro_batch_plan_covers_batch_with_at_most_n_parts(batch_size, num_micro_batch):
  plan = plan_micro_batches(batch_size, num_micro_batch=num_micro_batch)
  assert sum(plan.sizes) == batch_size
  assert len(plan.sizes) == plan.num_micro_batches <= num_micro_batch
  assert max(plan.sizes) == math.ceil(batch_size / num_micro_batch)
  assert plan.remainder < plan.micro_batch_size


@given(batch_size=st.integers(1, 500), micro_batch_size=st.integers(1, 64))
def test_micro_batch_size_plan_uses_that_size(batch_size, micro_batch_size):
  plan = plan_micro_batches(batch_size, micro_batch_size=micro_batch_size)
  assert sum(plan.sizes) == batch_size
  assert plan.micro_batch_size == min(micro_batch_size, batch_size)
  assert len(plan.sizes) == math.ceil(batch_size / plan.micro_batch_size)


def test_plan_rejects_empty_batch():
  with pytest.raises(ValueError, match='batch_size=0.*empty batch'):
    plan_micro_batches(0, num_micro_batch=2)

"""The combining arithmetic, tested without a trainer."""

import jax
import jax.numpy as jnp
import numpy as np

from brainpy_accum.core._combine import add_scaled, combine_values, finish_grads, wide_zeros_like
from brainpy_accum.core._metrics import MetricRule, stacked_partials


def test_low_precision_gradients_accumulate_in_float32():
  params = {'w': jnp.ones(3, jnp.bfloat16)}
  total = wide_zeros_like(params)
  assert total['w'].dtype == jnp.float32
  tiny = {'w': jnp.full(3, 1e-3, jnp.bfloat16)}
  for _ in range(1000):
    total = add_scaled(total, 1., tiny)
  grads = finish_grads(total, 1000., 'mean', params)
  assert grads['w'].dtype == jnp.bfloat16
  # In bfloat16 the running sum would stall near 0.25-0.5; in float32 the mean stays 1e-3.
  np.testing.assert_allclose(np.asarray(grads['w'], np.float32), 1e-3, rtol=1e-2)


def test_combine_values_weights_by_sample_count():
  values = {'loss': jnp.array([1., 3.])}
  np.testing.assert_allclose(combine_values(values, [3., 1.], 'mean')['loss'], 1.5)
  np.testing.assert_allclose(combine_values(values, [3., 1.], 'sum')['loss'], 4.)


def test_weighted_means_of_losses_and_metrics_are_products_and_sums_not_matmuls():
  """At their default precision accelerators round a float32 matmul's operands to bfloat16 (a TPU) or
  TensorFloat-32 (a GPU): a loss combined by ``jnp.tensordot`` was off by 1e-3 there (simulated on the CPU by
  rounding every ``dot_general``'s operands), where the micro-batches' own losses are exact to round-off."""
  values, weights = jnp.array([1.2345678, 2.3456789, 3.4567891]), jnp.array([3., 3., 4.])
  combined = jax.make_jaxpr(lambda v, w: combine_values(v, w, 'mean'))(values, weights)
  partials = jax.make_jaxpr(lambda v, w: stacked_partials([v], [MetricRule(None, 'mean')], w, w, True))(values, weights)
  assert 'dot_general' not in str(combined) and 'dot_general' not in str(partials)
  np.testing.assert_allclose(combine_values(values, weights, 'mean'), np.dot(values, weights) / 10., rtol=1e-7)

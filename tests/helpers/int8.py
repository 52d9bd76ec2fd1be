"""Models the INT8 tests share."""

import flax.linen as nn


class ConvNet(nn.Module):
  """Two convolutions (the second strided and grouped) and a dense head."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.relu(nn.Conv(8, (3, 3), strides=2, feature_group_count=2)(x))
    return nn.Dense(4)(x.reshape(x.shape[0], -1))

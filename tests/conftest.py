"""Shared test setup: two torch threads (the machine has two cores), deterministic models."""

import torch

torch.set_num_threads(2)

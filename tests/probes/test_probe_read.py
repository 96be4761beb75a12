"""probes/probe_read.py's pure part: the data-dependent patch embedding (``--patch-init pca``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mars.model.build import build_model, tiny_config
from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("probe_read", REPO / "probes" / "probe_read.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def tower() -> torch.nn.Module:
    return build_model(tiny_config(300), seed=0).model.visual  # patch embedding: 96 filters over 3*2*14*14 = 1176


def test_pca_patch_init_whitens_the_patches_it_was_fitted_on():
    visual = tower()
    g = torch.Generator().manual_seed(0)
    # correlated patches: 4,000 rows of a random mix of 1,176 inputs, split over two "images"
    x = torch.randn(4000, 1176, generator=g) @ torch.randn(1176, 1176, generator=g) * 0.1
    data = [(x[:2500], torch.tensor([[1, 50, 50]]), (0,)), (x[2500:], torch.tensor([[1, 30, 50]]), (1,))]
    probe.pca_patch_init(visual, data)
    w = visual.patch_embed.proj.weight.detach().reshape(96, -1)  # [H, C*T*P*P]
    y = (x - x.mean(0)) @ w.T  # [N, H]: what the patch embedding gives each centred patch
    cov = y.T @ y / (len(x) - 1)  # [H, H]
    # whitened: unit variance per filter, uncorrelated filters (all 4,000 patches < max_patches are used)
    assert torch.allclose(cov, torch.eye(96), atol=1e-3)
    # the filters are the leading components: the first captures more raw variance than the last
    raw = (x - x.mean(0)) @ torch.nn.functional.normalize(w, dim=1).T
    assert raw[:, 0].var() > raw[:, -1].var()


def test_pca_patch_init_needs_as_many_patches_as_filters():
    visual = tower()
    before = visual.patch_embed.proj.weight.detach().clone()
    with pytest.raises(ValueError, match="at least 96 patches.*raise --train"):
        probe.pca_patch_init(visual, [(torch.randn(40, 1176), torch.tensor([[1, 4, 10]]), (0,))])
    assert torch.equal(visual.patch_embed.proj.weight, before)  # nothing half-written

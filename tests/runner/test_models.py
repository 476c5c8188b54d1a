"""The models the recipes name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distlib.runner.models.parameters import count_params, param_groups
from distlib.runner.models.vision import build_model, resnet18_cifar, small_cnn


def test_resnet18_cifar_form():
    model = resnet18_cifar(10)
    assert count_params(model) == 11_173_962
    stem = model.conv1
    assert isinstance(stem, nn.Conv2d)
    assert (stem.kernel_size, stem.stride, stem.padding, stem.in_channels) == ((3, 3), (1, 1), (1, 1), 3)
    assert stem.bias is None
    assert isinstance(model.maxpool, nn.Identity)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())


def test_resnet18_cifar_forward_keeps_resolution_in_the_stem():
    model = resnet18_cifar(10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert model(x).shape == (2, 10)
        assert model.conv1(x).shape == (2, 64, 32, 32)  # stride 1: no downsampling before layer1
        assert model.layer4(model.layer3(model.layer2(model.layer1(model.conv1(x))))).shape == (2, 512, 4, 4)
    assert resnet18_cifar(100)(x).shape == (2, 100)


def test_small_cnn_and_build_model():
    model = build_model("small_cnn", num_classes=7, width=8)
    assert model(torch.randn(3, 3, 32, 32)).shape == (3, 7)
    assert count_params(build_model("resnet18_cifar", 10, 64)) == 11_173_962
    assert count_params(small_cnn(10, 8)) < count_params(small_cnn(10, 16))
    with pytest.raises(ValueError, match=r"unknown model 'vgg'; known: resnet18_cifar, small_cnn"):
        build_model("vgg", 10, 64)


def test_param_groups_decay_only_weights_of_convs_and_linears():
    model = resnet18_cifar(10)
    decay, no_decay = param_groups(model, 5e-4)
    assert decay["weight_decay"] == 5e-4 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim <= 1 for p in no_decay["params"])
    assert {id(p) for p in decay["params"] + no_decay["params"]} == {id(p) for p in model.parameters()}
    bn_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.BatchNorm2d)}
    assert bn_weights <= {id(p) for p in no_decay["params"]}

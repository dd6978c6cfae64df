"""The Python capture API: hooks, truncation, interventions (the hook tutorial's examples)."""

import pytest
import torch
import torch.nn as nn
from reference import resnet18

import extract
from extract import Capture, ExtractError, StopForward


class Net(nn.Module):
    """The tutorial's network."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 5)
        self.fc2 = nn.Linear(5, 1)

    def forward(self, x):
        x = self.fc1(x)
        x = torch.relu(x)
        x = self.fc2(x)
        return x


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_tutorial_capture_fc1():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 10)
    with extract.Capture(net, ["fc1"]) as cap:
        y = net(x)
    torch.testing.assert_close(cap["fc1"], net.fc1(x), rtol=0, atol=0)
    torch.testing.assert_close(y, net(x), rtol=0, atol=0)
    assert hook_count(net) == 0


def test_tutorial_intervention_in_place():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(8, 10)

    def hook(output):  # the tutorial's edit, verbatim: in place, returns None
        output[output > 0] = 1

    with Capture(net, ["fc1"], edit={"fc1": hook}) as cap:
        y = net(x)
    h = net.fc1(x)
    h[h > 0] = 1
    expected = net.fc2(torch.relu(h))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(cap["fc1"], h, rtol=0, atol=0)  # the capture sees the edited value
    assert hook_count(net) == 0

    # the tutorial's own code, with a raw hook, gives the same output
    handle = net.fc1.register_forward_hook(lambda m, i, o: hook(o))
    y_tutorial = net(x)
    handle.remove()
    torch.testing.assert_close(y, y_tutorial, rtol=0, atol=0)


def test_intervention_by_return_value():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 10)
    with Capture(net, ["fc2"], edit={"fc1": lambda o: torch.zeros_like(o)}) as cap:
        y = net(x)
    torch.testing.assert_close(y, net.fc2(torch.zeros(3, 5)), rtol=0, atol=0)
    torch.testing.assert_close(cap["fc2"], y)


def test_stop_skips_the_rest_of_the_forward():
    model = resnet18()
    calls = []
    model.fc.register_forward_hook(lambda *a: calls.append("fc"))
    x = torch.randn(2, 3, 32, 32)
    with Capture(model, ["layer2", "layer3"], stop=True) as cap:
        assert cap.forward(x) is None
    assert calls == [] and set(cap.outputs) == {"layer2", "layer3"}
    with Capture(model, ["layer2"], stop=True) as cap:
        model(x)  # StopForward raised here is swallowed by the with block
    assert calls == []
    with Capture(model, ["layer2"]) as full:
        model(x)
    assert calls == ["fc"]
    torch.testing.assert_close(cap["layer2"], full["layer2"], rtol=0, atol=0)
    assert hook_count(model) == 1


def test_hooks_removed_after_exception():
    model = resnet18()
    before = hook_count(model)
    with pytest.raises(ValueError):
        with Capture(model, ["layer1", "layer4"], edit={"layer2": lambda o: None}):
            assert hook_count(model) > before
            model(torch.randn(1, 3, 32, 32))
            raise ValueError("boom")
    assert hook_count(model) == before
    with pytest.raises(RuntimeError):
        with Capture(model, ["layer1"]):
            model(torch.randn(1, 5, 32, 32))  # wrong channels: the forward itself fails
    assert hook_count(model) == before


def test_capture_clones_against_in_place_ops():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(16, 4)
    with Capture(model, ["0"]) as cap:
        model(x)
    torch.testing.assert_close(cap["0"], model[0](x))
    assert (cap["0"] < 0).any()


def test_globs_stay_within_one_segment():
    model = resnet18()
    with Capture(model, ["layer*"]) as cap:
        pass
    assert [ref.name for ref in cap.refs] == ["layer1", "layer2", "layer3", "layer4"]
    with Capture(model, ["layer1.*"]) as cap:
        pass
    assert [ref.name for ref in cap.refs] == ["layer1.0", "layer1.1"]


def test_shared_module_is_refused():
    model = resnet18()
    with pytest.raises(ExtractError, match="ran 2 times"), Capture(model, ["layer1.0.relu"]):
        model(torch.randn(1, 3, 32, 32))


def test_unknown_edit_target():
    with pytest.raises(ExtractError, match="closest: fc2, fc1"):
        with Capture(Net(), ["fc2"], edit={"fc3": lambda o: o}):
            pass


def test_stop_forward_is_exported():
    assert issubclass(StopForward, Exception)

"""The Python capture API: hooks, truncation, interventions (the hook tutorial's examples)."""

import json

import pytest
import torch
import torch.nn as nn
from helpers.reference import resnet18
from helpers.tiny_models import dict_net

import extract
from extract import Capture, ExtractError, StopForward
from extract.capture.setup import list_layers
from extract.names.layout import Layout
from extract.store.arrays import dimension_names


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


# --- a module's input (NAME@input) --------------------------------------------------------------


def test_an_input_is_what_the_module_receives_after_an_edit_upstream():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(6, 10)

    def hook(output):  # the tutorial's edit
        output[output > 0] = 1

    with Capture(net, ["fc2@input", "fc1@input", "fc1"], edit={"fc1": hook}) as cap:
        y = net(x)
    h = net.fc1(x)
    h[h > 0] = 1
    torch.testing.assert_close(cap["fc1@input"], x, rtol=0, atol=0)
    torch.testing.assert_close(cap["fc2@input"], torch.relu(h), rtol=0, atol=0)  # relu runs between fc1 and fc2
    torch.testing.assert_close(y, net.fc2(torch.relu(h)), rtol=0, atol=0)
    assert [ref.name for ref in cap.refs] == ["fc1@input", "fc1", "fc2@input"]  # an input before its output
    assert hook_count(net) == 0


def test_an_input_fires_before_its_module_so_stop_skips_the_module():
    model = resnet18()
    calls = []
    model.layer4.register_forward_hook(lambda *a: calls.append("layer4"))
    x = torch.randn(2, 3, 32, 32)
    with Capture(model, ["layer4@input"], stop=True) as cap:
        assert cap.forward(x) is None
    assert calls == []
    with Capture(model, ["layer3"]) as full:
        model(x)
    torch.testing.assert_close(cap["layer4@input"], full["layer3"], rtol=0, atol=0)
    with Capture(model, ["layer*@input"]) as cap:
        pass
    assert [ref.name for ref in cap.refs] == [f"layer{i}@input" for i in range(1, 5)]
    with Capture(model, ["layer4@input"], retain="shape") as shapes:
        model(x)
    assert shapes.by_module() == {"layer4@input": [full["layer3"].shape]}


class Keyworded(nn.Module):
    """A block taking its input by keyword, as transformers' blocks and attention modules may."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, hidden_states=None, features=None):
        return self.fc(hidden_states if hidden_states is not None else features)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Keyworded(), Keyworded()

    def forward(self, x):
        return self.b(features=self.a(hidden_states=x))


def test_an_input_given_by_keyword_is_the_hidden_states_one_and_no_other():
    torch.manual_seed(0)
    model, x = Keywords(), torch.randn(3, 4)
    seen = []
    handle = model.a.register_forward_pre_hook(lambda m, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    with Capture(model, ["a@input", "a.fc@input"]) as cap:
        model(x)
    handle.remove()
    assert seen[0][0] == () and seen[0][1]["hidden_states"] is x  # the plain pre-hook's view: a keyword
    torch.testing.assert_close(cap["a@input"], x, rtol=0, atol=0)
    torch.testing.assert_close(cap["a.fc@input"], x, rtol=0, atol=0)
    with pytest.raises(ExtractError) as error, Capture(model, ["b@input"]):
        model(x)
    assert str(error.value) == (
        "layer 'b@input': b is called with no argument and no hidden_states= (keywords features), so its input is "
        "not a tensor; capture another module's input or output (see --list-layers)"
    )
    rows = {row[0]: row for row in list_layers(model, model, x, x)}
    assert rows["b@input"][2] == "no positional argument nor hidden_states= (not a tensor: not capturable)"
    assert rows["a@input"][1:3] == ("Keyworded", "(B, 4)") and rows["b.fc@input"][2] == "(B, 4)"


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ("fc2@inputs", "'@' spells a module's input, NAME@input"),
        ("fc2:0@input", "routing, BLOCK@router (one tensor: no ':' selector)"),
        ("fc2@router", "fc2 is not a mixture-of-experts block"),
        ("fc3@input", "layer 'fc3@input' matches no module; closest: fc2@input, fc1@input"),
    ],
)
def test_misspelled_inputs_are_one_line(layer, message):
    with pytest.raises(ExtractError) as error:
        Capture(Net(), [layer])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_shared_module_is_refused():
    model = resnet18()
    with pytest.raises(ExtractError, match="ran 2 times"), Capture(model, ["layer1.0.relu"]):
        model(torch.randn(1, 3, 32, 32))


def test_unknown_edit_target():
    with pytest.raises(ExtractError, match="closest: fc2, fc1"):
        with Capture(Net(), ["fc2"], edit={"fc3": lambda o: o}):
            pass


def test_stop_forward_from_an_edit_stops_the_forward_before_later_modules():
    """``extract.StopForward`` raised anywhere in the forward ends it, and the capture swallows it."""
    net, x = Net(), torch.randn(2, 10)
    later = []
    net.fc2.register_forward_hook(lambda *a: later.append("fc2"))

    def stop(output):
        raise extract.StopForward

    with Capture(net, ["fc1"], edit={"fc1": stop}) as cap:
        assert cap.forward(x) is None
    assert later == [] and set(cap.outputs) == set()
    with Capture(net, ["fc1"], edit={"fc1": stop}):
        net(x)  # the with block swallows it too
    assert later == [] and hook_count(net) == 1
    handle = net.fc1.register_forward_hook(lambda m, i, o: stop(o))
    with pytest.raises(StopForward):  # without a capture nothing swallows it
        net(x)
    handle.remove()


def test_retain_shape_records_every_call_of_every_module():
    model = resnet18()
    x = torch.randn(2, 3, 32, 32)
    with Capture(model, retain="shape") as cap:
        y = model(x)
    shapes = cap.by_module()
    assert set(shapes) == {name for name, _ in model.named_modules() if name}
    assert shapes["layer3"] == [torch.Size([2, 256, 2, 2])]
    assert shapes["layer1.0.relu"] == [torch.Size([2, 64, 8, 8])] * 2, "a shared module: one entry a call"
    assert shapes["fc"] == [y.shape] and cap.outputs == {}
    assert [name for name, _ in cap.seen][-1] == "fc", "in the order the calls returned"
    with Capture(model, ["layer1.0.relu", "layer2"], retain="shape") as only:
        model(x)
        model(x[:1])  # a new forward starts a new record
    assert only.by_module() == {
        "layer1.0.relu": [torch.Size([1, 64, 8, 8])] * 2,
        "layer2": [torch.Size([1, 128, 4, 4])],
    }
    assert hook_count(model) == 0


def test_retain_shape_keeps_tuple_and_dict_structure():
    model = dict_net()
    with Capture(model, retain="shape") as cap:
        model(torch.randn(3, 3, 32, 32))
    (tree,) = cap.by_module()["heads"]
    assert isinstance(tree, dict) and all(isinstance(shape, torch.Size) for shape in tree.values())


def test_retain_reference_keeps_the_output_objects_themselves():
    net, x = Net(), torch.randn(4, 10)
    with Capture(net, retain="reference") as cap:
        y = net(x)
    ((name, kept),) = [(n, o) for n, o in cap.seen if n == "fc2"]
    assert kept is y, "the very tensor the module returned, not a clone"
    assert [n for n, _ in cap.seen] == ["fc1", "fc2"]


def test_retain_reference_sees_an_edit():
    net, x = Net(), torch.randn(4, 10)
    with Capture(net, ["fc1"], retain="reference", edit={"fc1": lambda o: torch.zeros_like(o)}) as cap:
        net(x)
    assert cap.by_module()["fc1"][0].eq(0).all()


def test_retain_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="choose one of output, shape, reference"):
        Capture(Net(), retain="clone")
    with pytest.raises(ValueError, match="reduce and sink apply to retain='output'"):
        Capture(Net(), retain="shape", sink=lambda name, value: None)


def test_layout_type_is_one_definition_that_stays_a_plain_string():
    assert [str(layout) for layout in Layout] == ["NCHW", "NHWC", "NLC", "NCL"]
    assert json.dumps({"a": Layout.NHWC}) == json.dumps({"a": "NHWC"}) and f"{Layout.NLC}" == "NLC"
    assert Layout.NHWC.spatial_axes == (1, 2) and Layout.NCHW.spatial_axes == (2, 3) and Layout.NLC.spatial_axes is None
    assert Layout.NCL.token_axis == 2 and Layout.NLC.token_axis == 1 and Layout.NCHW.token_axis is None
    assert dimension_names("x", 3, "NHWC") == ("sample", "x.height", "x.width", "x.channel")
    assert dimension_names("x", 2, Layout.NCL) == ("sample", "x.dim", "x.token")
    assert dimension_names("x", 2, "NCHW") == ("sample", "x.token", "x.dim"), "a layout of the wrong rank is ignored"

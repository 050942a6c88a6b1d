"""What a thin device runs, built from its own install: W_c and the calibration trunk in numpy.

The wire carries weights, never graphs (PROTOCOL.md): a thin device builds the network of the
model its round plan names from the layers of methods/thin, and what it receives are named
arrays, checked against that network (names, shapes, dtypes, finiteness, magnitude, the sizes
the architecture fixes) before they are bound. A weight map that does not fit leaves the graph
in use untouched. A model this install has no thin architecture for is refused in one line
before the device takes part (a device with torch can run it).

Two graphs per model, the same state names as the torch split (models/), so the weight maps the
cloud sends load as they are:
- W_c, the device's extractor (`wc_graph`): the thin trainer's network, run in eval mode;
- the calibration trunk (`calib_graph`): W_e and W_g without its classifier on W_c's output
  (models.ClassifierInput: "we.*", "wg.*"), what head calibration runs on a device.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from splitedge.methods.checks import check_weight_map, weight_specs
from splitedge.methods.thin.layers import (
    BatchNorm2d, Conv2d, Layer, Linear, MaxPool2d, ReLU, Sequential, global_avg_pool, global_avg_pool_backward,
)
from splitedge.methods.thin.trainer import eval_forward
from splitedge.methods.thin.plugins import thin_plugin, thin_plugins
from splitedge.methods.thin.wc_models import WIDTH, thin_wc
from splitedge.protocol.errors import ProtocolError

HIDDEN = 256
"""fedcnn's classifier width (models/fedcnn.py's default)."""


class Flatten(Layer):
    """[N, ...] -> [N, prod(...)] (nn.Flatten(1))."""

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        if train:
            self._saved_shape = x.shape
        return x.reshape(len(x), -1)

    def backward(self, grad: np.ndarray) -> np.ndarray:
        shape, self._saved_shape = self._saved_shape, None
        return grad.reshape(shape)


class GlobalAvgPool(Layer):
    """nn.AdaptiveAvgPool2d(1) followed by nothing: [N, C, H, W] -> [N, C, 1, 1]."""

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        if train:
            self._saved_shape = x.shape
        return global_avg_pool(x)[:, :, None, None]

    def backward(self, grad: np.ndarray) -> np.ndarray:
        shape, self._saved_shape = self._saved_shape, None
        return global_avg_pool_backward(grad.reshape(shape[:2]), shape)


def _conv_block(c_in: int, c_out: int, stride: int = 1) -> Sequential:
    return Sequential([("conv", Conv2d(c_in, c_out, 3, stride, 1)), ("bn", BatchNorm2d(c_out)), ("relu", ReLU())])


def _cnn_calib(channels: int, image_size: int, classes: int, width: int) -> Sequential:
    """models/cnn.py: W_e is two conv blocks, W_g's trunk a global average pool."""
    we = Sequential([("block3", _conv_block(width, 2 * width)), ("block4", _conv_block(2 * width, 2 * width, 2))])
    return Sequential([("we", we), ("wg", Sequential([("avgpool", GlobalAvgPool()), ("flatten", Flatten())]))])


def _fedcnn_calib(channels: int, image_size: int, classes: int, width: int) -> Sequential:
    """models/fedcnn.py: W_e is stages 2 and 3, W_g's trunk flatten -> fc1 -> ReLU."""
    def stage(c_in: int, c_out: int) -> Sequential:
        return Sequential([("block", _conv_block(c_in, c_out)), ("pool", MaxPool2d())])

    side = image_size // 8
    we = Sequential([("stage2", stage(width, 2 * width)), ("stage3", stage(2 * width, 4 * width))])
    wg = Sequential([("flatten", Flatten()), ("fc1", Linear(4 * width * side * side, HIDDEN)), ("relu", ReLU())])
    return Sequential([("we", we), ("wg", wg)])


def _fedcnn2_calib(channels: int, image_size: int, classes: int, width: int) -> Sequential:
    """models/fedcnn.py's fedcnn2: W_e is stage 3, W_g's trunk flatten -> fc1 -> ReLU."""
    side = image_size // 8
    we = Sequential([("stage3", Sequential([("block", _conv_block(2 * width, 4 * width)), ("pool", MaxPool2d())]))])
    wg = Sequential([("flatten", Flatten()), ("fc1", Linear(4 * width * side * side, HIDDEN)), ("relu", ReLU())])
    return Sequential([("we", we), ("wg", wg)])


class BasicBlock(Sequential):
    """torchvision's ResNet BasicBlock (conv-bn-relu-conv-bn, plus the input or its 1x1
    projection, then ReLU) under its state names; inference only."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        children: list[tuple[str, Layer]] = [
            ("conv1", Conv2d(c_in, c_out, 3, stride, 1)), ("bn1", BatchNorm2d(c_out)), ("relu", ReLU()),
            ("conv2", Conv2d(c_out, c_out, 3, 1, 1)), ("bn2", BatchNorm2d(c_out))]
        if stride != 1 or c_in != c_out:
            children.append(("downsample", Sequential([("0", Conv2d(c_in, c_out, 1, stride, 0)),
                                                       ("1", BatchNorm2d(c_out))])))
        super().__init__(children)

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        layers = dict(self.children)
        out = x
        for name in ("conv1", "bn1", "relu", "conv2", "bn2"):
            out = layers[name].forward(out, train)
        out += layers["downsample"].forward(x, train) if "downsample" in layers else x
        return np.maximum(out, 0, out=out)

    def backward(self, grad: np.ndarray) -> np.ndarray:
        raise NotImplementedError("the thin trainer does not train ResNet blocks")


def _resnet_layer(c_in: int, c_out: int, stride: int) -> Sequential:
    return Sequential([("0", BasicBlock(c_in, c_out, stride)), ("1", BasicBlock(c_out, c_out, 1))])


def _resnet18_wc(channels: int) -> Sequential:
    """models/resnet.py's default split: the CIFAR stem and layer1 on the device."""
    return Sequential([("conv1", Conv2d(channels, 64, 3, 1, 1)), ("bn1", BatchNorm2d(64)), ("relu", ReLU()),
                       ("layer1", _resnet_layer(64, 64, 1))])


def _resnet18_calib(channels: int, image_size: int, classes: int, width: int) -> Sequential:
    """layer2 and layer3 (W_e), layer4, average pool and flatten (W_g's trunk)."""
    we = Sequential([("layer2", _resnet_layer(64, 128, 2)), ("layer3", _resnet_layer(128, 256, 2))])
    wg = Sequential([("layer4", _resnet_layer(256, 512, 2)), ("avgpool", GlobalAvgPool()), ("flatten", Flatten())])
    return Sequential([("we", we), ("wg", wg)])


CALIB_BUILDERS: dict[str, Callable[[int, int, int, int], Sequential]] = {
    "cnn": _cnn_calib, "fedcnn": _fedcnn_calib, "fedcnn2": _fedcnn2_calib, "resnet18": _resnet18_calib}
"""Model name -> the calibration trunk's builder (channels, image size, classes, width)."""


def thin_models() -> list[str]:
    """The models a thin device can run: those whose W_c and trunk this install defines, and
    the thin models of one's own this process registered (methods/thin/plugins.py)."""
    return sorted(CALIB_BUILDERS) + thin_plugins()


def calib_net(model: str, channels: int, image_size: int, classes: int, width: int = WIDTH) -> Sequential:
    """Sequential([("we", W_e), ("wg", W_g's trunk)]) of `model` in numpy layers; ValueError
    for a model of one's own whose ThinModel has no `calib`."""
    if model in CALIB_BUILDERS:
        return CALIB_BUILDERS[model](int(channels), int(image_size), int(classes), int(width))
    plugged = thin_plugin(model)
    if plugged is None or plugged.calib is None:
        raise ValueError(f"this install defines no thin W_e and W_g for {model!r} (its ThinModel has no calib: "
                         f"thin devices of it cannot calibrate a head or run FedAvg)")
    return plugged.calib(int(channels), int(image_size), int(classes))


class LocalGraph:
    """A network of this install with weights bound only after they were checked against it.

    `features` runs it in eval mode; `load_weights` binds a whole weight map or nothing; the
    network itself never changes, whatever arrives."""

    numpy_state = True  # methods/snapshot.py keeps it (a parked or restarted device) as arrays

    def __init__(self, net: Sequential, *, pre_relu: bool = False) -> None:
        self.net, self.pre_relu = net, bool(pre_relu)
        self.specs = weight_specs(net.state())
        self.loaded = False  # whether weights from the federation are bound (its zeros are nobody's model)

    @property
    def size(self) -> int:
        """Values in a weight map of this network: the most a map for it may carry."""
        return int(sum(int(np.prod(shape)) for shape, _ in self.specs.values()))

    def check_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """ProtocolError ("state.weights", "state.range") naming the first thing that does not fit."""
        check_weight_map(weights, self.specs, bounded=False)
        for name, arr in weights.items():
            if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
                raise ProtocolError("state.weights", f"{name}: non-finite values")

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Bind a weight map (all of it, or nothing: ProtocolError keeps the weights in use)."""
        self.check_weights(weights)
        self.net.load(dict(weights))
        self.loaded = True

    def weights(self) -> dict[str, np.ndarray]:
        return self.net.state()

    def features(self, x: np.ndarray) -> np.ndarray:
        """Normalised float32 images (or W_c features) [N, ...] -> this network's output, float32."""
        if self.pre_relu:
            return eval_forward(self.net, x, pre_relu=True)
        return self.net.forward(np.ascontiguousarray(x, dtype=np.float32), train=False)

    def stages(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(W_e's output, the trunk's) of W_c features `h`: a calibration graph's two children
        run one after the other (`calib_graph`), float32."""
        (_, we), (_, wg) = self.net.children
        e = we.forward(np.ascontiguousarray(h, dtype=np.float32), train=False)
        return e, wg.forward(e, train=False)

    def state_dict(self) -> dict[str, object]:
        """The bound weights (None before any arrived): what a parked device keeps of its graph."""
        return {"weights": self.net.state() if self.loaded else None}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        weights = state.get("weights")
        if weights is not None:
            self.net.load(dict(weights))  # type: ignore[arg-type]
            self.loaded = True


def _check_model(model: str) -> None:
    if model not in thin_models():
        raise ValueError(f"a thin device runs the models of its install, {thin_models()}, not {model!r} "
                         f"(a device with torch can: --backend torch)")


def wc_graph(model: str, channels: int, *, pre_relu: bool = False, width: int = WIDTH) -> LocalGraph:
    """W_c of `model` (without its last ReLU with pre_relu); ValueError for a model this install lacks."""
    _check_model(model)
    if model == "resnet18":
        if pre_relu:
            raise ValueError("pre_relu needs W_c ending in a ReLU layer; resnet18's ends in a residual block")
        return LocalGraph(_resnet18_wc(int(channels)))
    return LocalGraph(thin_wc(model, channels, width), pre_relu=pre_relu)


def calib_graph(model: str, channels: int, image_size: int, classes: int, *, width: int = WIDTH) -> LocalGraph:
    """W_e and W_g's trunk of `model` on W_c's output (models.ClassifierInput's state names)."""
    _check_model(model)
    return LocalGraph(calib_net(model, channels, image_size, classes, width))

"""The quantization-method contract: what ``qconfig.weight.method`` names, and how it is found.

A method is a :class:`QuantMethod` subclass registered under its YAML name in the entry-point group
``msquant.methods`` (``name = "package.module:MethodClass"``), exactly as processors are in
``msquant.processors``. The class binds:

* ``name``: the value of ``qconfig.weight.method``;
* ``options_class``: its typed ``ext`` (a :class:`MethodOptions`, ``extra="forbid"``), so the
  config schema validates ``ext`` per method and ``msquant schema`` documents every key;
* ``dtypes`` / ``scopes``: the ``(dtype, scope)`` combinations it implements;
* what it does with one module: round-to-nearest (:meth:`QuantMethod.quantize_rtn`), and for
  methods that learn from calibration data (``calibrated = True``) a per-module
  :class:`CalibratedQuantizer` gathering a Hessian (:meth:`QuantMethod.new_quantizer`) and its
  solve (:meth:`QuantMethod.solve`).

The ``linear_quant`` processor builds one method object per entry (``method_class(weight)``, with
the entry's validated ``qconfig.weight``) and asks it; the engine names no method.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from importlib.metadata import EntryPoint
from typing import Annotated, Any, ClassVar, Literal, Protocol, Union

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidatorFunctionWrapHandler,
    create_model,
    model_serializer,
    model_validator,
)

from msquant.backends.base import Backend
from msquant.errors import ConfigIssue, RegistryError
from msquant.model.moe.token_counts import enough_expert_tokens
from msquant.quant.hessian import HessianAccumulator
from msquant.quant.qconfig import QDType, QScope, WeightQConfig
from msquant.quant.quantized_weight import QuantizedWeight
from msquant.quant.rules import BaseScheme, DynamicRule, ResolvedScheme
from msquant.registry_base import (
    PluginError,
    PluginProblem,
    check_entry_point_name,
    claim,
    plugin_classes,
    register_plugins,
)

__all__ = [
    "METHOD_ENTRY_POINT_GROUP",
    "MethodOptions",
    "CalibratedQuantizer",
    "QuantMethod",
    "MethodRegistry",
    "default_method_registry",
]

#: The entry-point group quantization methods are registered in (``name = "package.module:Class"``).
METHOD_ENTRY_POINT_GROUP = "msquant.methods"
logger = logging.getLogger(__name__)


class MethodOptions(BaseModel):
    """Base of a method's typed ``ext``: unknown keys are refused, naming the valid ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The method these options belong to (set by :meth:`MethodRegistry.register`).
    method_name: ClassVar[str] = ""

    _given: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_order(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Keep the order the config wrote its keys in (see :meth:`_as_given`)."""
        options = handler(data)
        if isinstance(data, Mapping) and isinstance(options, MethodOptions):
            options._given = tuple(str(key) for key in data)
        return options

    @model_serializer(mode="wrap")
    def _as_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Serialise the keys the config gave, in its order, not the defaults: a config dumped
        (the copy a saver writes beside the export, the hash in the run report) reads as it was
        written."""
        data = handler(self)
        order = [key for key in self._given if key in data]
        order += [key for key in data if key not in order]
        return {key: data[key] for key in order if key in self.model_fields_set}

    @classmethod
    def unknown_key_message(cls) -> str:
        """What the config validation says about an unknown ``ext`` key."""
        return f"unknown {cls.method_name} option; valid: {', '.join(cls.model_fields)}"


class CalibratedQuantizer(Protocol):
    """One module's calibration state: a Hessian gathered from its inputs.

    ``linear_quant`` feeds it the module's inputs, shares one ``accumulator`` between modules
    reading the same tensor (q/k/v), sums it over the processes of a ``dp_layer_wise`` group, and
    hands it back to :meth:`QuantMethod.solve`.
    """

    accumulator: HessianAccumulator

    @property
    def nsamples(self) -> int:
        """Calibration tokens gathered (padding excluded)."""

    def add_batch(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Gather one batch of the module's inputs ``[..., in_features]``."""


class QuantMethod(ABC):
    """A weight quantization method of ``linear_quant``: one object per config entry.

    :param weight: the entry's validated ``qconfig.weight`` (its ``ext`` is ``options_class``).
    """

    name: ClassVar[str]
    options_class: ClassVar[type[MethodOptions]]
    dtypes: ClassVar[frozenset[QDType]]
    scopes: ClassVar[frozenset[QScope]]
    summary: ClassVar[str]
    #: Whether modules are solved from calibration data (Hessians) instead of rounded.
    calibrated: ClassVar[bool] = False
    #: The ``dynamic`` override keys an entry of this method accepts.
    rule_keys: ClassVar[tuple[str, ...]]

    def __init__(self, weight: WeightQConfig) -> None:
        self.weight = weight
        self.options = weight.ext

    @property
    def bits(self) -> int:
        """The entry's code width."""
        return self.weight.dtype.bits

    @property
    def group_size(self) -> int | None:
        """The entry's group width, None per-channel (rules may override it per module)."""
        if self.weight.scope is not QScope.PER_GROUP:
            return None
        return int(self.options.group_size)  # type: ignore[attr-defined]

    def config_issues(self, rules: Sequence[DynamicRule]) -> list[ConfigIssue]:
        """Method-specific problems of the entry's ``dynamic`` rules (none by default)."""
        return []

    @abstractmethod
    def base_scheme(self) -> BaseScheme:
        """The scheme every selected module gets when no ``dynamic`` rule overrides it."""

    @abstractmethod
    def quantize_rtn(
        self, weight: torch.Tensor, scheme: ResolvedScheme, name: str
    ) -> QuantizedWeight:
        """Round-to-nearest weight of one module under its resolved scheme."""

    def rtn_baseline(
        self,
        weight: torch.Tensor,
        scheme: ResolvedScheme,
        name: str,
        solved: QuantizedWeight,
        stats: Mapping[str, Any],
    ) -> QuantizedWeight:
        """The round-to-nearest weight a solved module's report compares the solve with (its
        ``rtn_output_error``), given the solve's result and report fields (``stats``).

        The default is :meth:`quantize_rtn`. A method whose solve already derived
        round-to-nearest's grid parameters from the same weight (GPTQ per-channel, or with static
        groups) overrides it to round with those instead of deriving them again (with the MSE
        scale search, that search is most of the rounding's cost).
        """
        return self.quantize_rtn(weight, scheme, name)

    # -- calibrated methods (``calibrated = True``) ---------------------------------------------

    @property
    def calibrate_on_quantized(self) -> bool:
        """Whether each decoder layer is calibrated on the quantized previous layers' outputs."""
        return False

    @property
    def true_sequential(self) -> bool:
        """Whether a layer's submodules (attention, MLP) are quantized one after the other."""
        return False

    @property
    def experts_per_pass(self) -> int | None:
        """How many MoE experts gather Hessians per calibration pass (None: all)."""
        return None

    @property
    def expert_min_tokens(self) -> float:
        """MoE experts with fewer tokens than this times ``in_features`` are rounded instead."""
        return float(getattr(self.options, "expert_min_tokens", 0.0))

    def solves_expert(self, token_count: int, in_features: int) -> bool:
        """Whether an MoE expert's linear layer that received ``token_count`` calibration tokens
        is solved by this method; otherwise it is rounded to nearest (:meth:`quantize_rtn`).
        The default: at least :attr:`expert_min_tokens` x ``in_features`` tokens, and one."""
        return enough_expert_tokens(token_count, in_features, self.expert_min_tokens)

    # -- memory (``--max_memory``: the estimate before any weight is loaded) --------------------

    def quantizer_bytes(self, in_features: int) -> int:
        """Bytes one module's calibration state (:meth:`new_quantizer`) holds once fed, for a
        module reading ``in_features`` values: a Hessian and its staging buffer for calibrated
        methods (:meth:`msquant.plugin.numerics.HessianAccumulator.footprint`), nothing otherwise."""
        return HessianAccumulator.footprint(in_features) if self.calibrated else 0

    def work_bytes(self, out_features: int, in_features: int) -> int:
        """The most memory quantizing one ``[out_features, in_features]`` module takes beyond its
        weight and its calibration state (the solve's or the rounding's working copies). The
        default: three float32 copies of the weight, what min/max rounding makes at most."""
        return 3 * out_features * in_features * 4

    def new_quantizer(
        self, name: str, in_features: int, scheme: ResolvedScheme
    ) -> CalibratedQuantizer:
        """A module's calibration state (calibrated methods only)."""
        raise NotImplementedError(f"method {self.name} is not calibrated")

    def solve(
        self,
        quantizer: CalibratedQuantizer,
        weight: torch.Tensor,
        backend: Backend,
    ) -> tuple[QuantizedWeight, Mapping[str, Any]]:
        """The module's quantized weight and the fields of its report entry
        (:class:`msquant.plugin.ModuleReport`) the solve fills in (calibrated methods only)."""
        raise NotImplementedError(f"method {self.name} is not calibrated")


class MethodRegistry:
    """Method names (``qconfig.weight.method``) -> :class:`QuantMethod` classes."""

    def __init__(self, methods: Iterable[type[QuantMethod]] = ()) -> None:
        self._classes: dict[str, type[QuantMethod]] = {}
        self._problems: dict[str, PluginProblem] = {}
        for cls in methods:
            self.register(cls)

    def register(self, cls: type[QuantMethod]) -> type[QuantMethod]:
        """Register ``cls`` under ``cls.name``; usable as a decorator.

        :raises RegistryError: a malformed class, or a name taken by another class.
        """
        _check_method_class(cls)
        claim(self._classes, cls.name, cls, "quantization method")
        cls.options_class.method_name = cls.name
        return cls

    def load_entry_points(self, group: str = METHOD_ENTRY_POINT_GROUP) -> MethodRegistry:
        """Register every method advertised in the entry-point ``group``; returns ``self``.
        A plugin that cannot be registered is set aside: :meth:`get` refuses its name."""
        # mypy takes no abstract class for type[T] (python/mypy#4717); the subclasses are concrete.
        found, problems = plugin_classes(group, QuantMethod, "quantization method")  # type: ignore[type-abstract]

        def register(ep: EntryPoint, cls: type[QuantMethod]) -> None:
            _check_method_class(cls)
            check_entry_point_name(ep, cls.name, "quantization method")
            self.register(cls)

        self._problems.update(
            register_plugins(
                group,
                found,
                problems,
                register,
                lambda name: self._classes.pop(name, None),
                "quantization method",
            )
        )
        return self

    def problem(self, name: str) -> PluginProblem | None:
        """Why the plugin registered as ``name`` was set aside, or None."""
        return self._problems.get(name)

    def get(self, name: str) -> type[QuantMethod]:
        """The class registered as ``name``.

        :raises PluginError: when the plugin of that name was set aside.
        :raises KeyError: listing the registered names when ``name`` is unknown.
        """
        if name in self._problems:
            raise PluginError(self._problems[name])
        try:
            return self._classes[name]
        except KeyError:
            raise KeyError(f"unknown method {name!r}; valid: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self._classes)

    def weight_config_type(self) -> Any:
        """The type of ``qconfig.weight``: a union of one :class:`WeightQConfig` per method,
        discriminated on ``method``, each with that method's typed ``ext``."""
        if not self._classes:
            raise RegistryError(
                f"no quantization method is registered (entry-point group {METHOD_ENTRY_POINT_GROUP!r}); "
                "reinstall msquant (pip install -e .) so that its entry points are recorded"
            )
        members = tuple(_weight_config_class(self._classes[n]) for n in self.names())
        return Annotated[Union[members], Field(discriminator="method")]  # noqa: UP007

    def __contains__(self, name: object) -> bool:
        return name in self._classes


def _weight_config_class(cls: type[QuantMethod]) -> type[WeightQConfig]:
    """``qconfig.weight`` for one method: ``method: Literal[name]`` and its typed ``ext``."""
    options = cls.options_class
    tag: Any = Literal[cls.name]
    return create_model(
        f"WeightQConfig_{cls.name}",
        __base__=WeightQConfig,
        __doc__=(WeightQConfig.__doc__ or "").split("\n\n")[0],
        method=(tag, Field(description=WeightQConfig.model_fields["method"].description)),
        ext=(
            options,
            Field(
                default_factory=options, description=WeightQConfig.model_fields["ext"].description
            ),
        ),
    )


def _check_method_class(cls: type[QuantMethod]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, QuantMethod)):
        raise RegistryError(f"{cls!r} is not a msquant.plugin.QuantMethod subclass")
    for attr in ("name", "options_class", "dtypes", "scopes", "summary", "rule_keys"):
        if not hasattr(cls, attr):
            raise RegistryError(f"method {cls.__qualname__} must define class attribute {attr!r}")
    if not isinstance(cls.name, str) or not cls.name:
        raise RegistryError(f"{cls.__qualname__}.name must be a non-empty string")
    options = cls.options_class
    if not (isinstance(options, type) and issubclass(options, MethodOptions)):
        raise RegistryError(f"{cls.__qualname__}.options_class must subclass MethodOptions")


def default_method_registry() -> MethodRegistry:
    """A new registry holding every method installed in the ``msquant.methods`` group."""
    return MethodRegistry().load_entry_points()

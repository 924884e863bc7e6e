"""A config's _target_ is checked before Hydra calls it: plugin classes (and annotated factories) only."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from core.interfaces import Router
from experiments.build import build_workload, instantiate_group
from experiments.targets import check_targets, protocol_methods
from policies.routers.round_robin import RoundRobinRouter


class MyRouter:  # a user's own router: structural, no base class
    def route(self, request, replicas) -> int:
        return 0


def make_router() -> MyRouter:
    return MyRouter()


def make_unannotated():
    return MyRouter()


def test_protocol_methods_come_from_the_protocol():
    assert protocol_methods(Router) == ("route",)


@pytest.mark.parametrize("group", ["workload", "scheduler", "eviction", "router", "cost_model"])
@pytest.mark.parametrize("target", ["os.system", "builtins.eval", "subprocess.run", "shutil.rmtree"])
def test_callables_that_are_not_plugins_are_refused_before_any_call(tmp_path, group, target):
    marker = tmp_path / "ran"
    node = OmegaConf.create({"_target_": target, "command": f"touch {marker}"})
    with pytest.raises(ValueError, match=rf"^{group}\._target_='{target}'.*refusing to call it"):
        instantiate_group(node, group)
    assert not marker.exists()


def test_a_nested_target_is_checked_too(tmp_path):
    marker = tmp_path / "ran"
    node = {"_target_": "core.workload.combinators.Mix", "seed": 0,
            "parts": {"a": {"_target_": "os.system", "command": f"touch {marker}"}}}
    with pytest.raises(ValueError, match=r"workload\.parts\.a\._target_='os.system'"):
        build_workload(node)
    assert not marker.exists()


def test_a_class_of_another_group_names_the_missing_methods():
    node = OmegaConf.create({"_target_": "policies.routers.random.RandomRouter"})
    with pytest.raises(ValueError, match=r"does not implement Workload \(missing initial, on_finish\)"):
        instantiate_group(node, "workload")


def test_an_unimportable_target_says_so():
    with pytest.raises(ValueError, match=r"router\._target_='no_such_module.X': cannot import it"):
        instantiate_group(OmegaConf.create({"_target_": "no_such_module.X"}), "router")


def test_user_classes_and_annotated_factories_are_accepted():
    assert isinstance(instantiate_group(OmegaConf.create({"_target_": f"{__name__}.MyRouter"}), "router"), MyRouter)
    assert isinstance(instantiate_group(OmegaConf.create({"_target_": f"{__name__}.make_router"}), "router"),
                      MyRouter)
    assert isinstance(instantiate_group(OmegaConf.create(
        {"_target_": "policies.routers.round_robin.RoundRobinRouter"}), "router"), RoundRobinRouter)
    with pytest.raises(ValueError, match="factory function annotated"):
        check_targets({"_target_": f"{__name__}.make_unannotated"}, "router")


def test_a_factory_returning_a_union_is_checked_member_by_member():
    check_targets({"_target_": "sim.cost.calibrated.load_calibration", "path": "x"}, "cost_model")  # no error

"""Step-time cost models for the simulator: roofline (from model + hardware) and linear (fitted)."""

from sim.cost.base import CostModel, decode_features, prefill_features
from sim.cost.linear import LinearCostModel
from sim.cost.roofline import OpCost, RooflineCostModel

__all__ = ["CostModel", "LinearCostModel", "OpCost", "RooflineCostModel", "decode_features", "prefill_features"]

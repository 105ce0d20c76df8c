"""The placement pass (dtype of "follow" ops chosen so the fewest bytes are cast), by topic.

- :mod:`.cut`: the minimum cut and ``PlacementRule`` / ``place_casts``;
- :mod:`.free`: which follow ops may move (the allowlist);
- :mod:`.model`: the cut's values, consumers and cast costs.
"""
from .cut import PlacementRule, place_casts

__all__ = ["PlacementRule", "place_casts"]

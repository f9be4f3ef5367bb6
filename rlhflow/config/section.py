"""The base of every params.yaml section model, and how one section inherits the keys it does not set from another.

Some sections repeat another's settings: the judge is trained as the reward model is, and SFT and PPO train
LoRA adapters of the same shape. Such a section (the child) takes every key it shares with its parent from the
parent unless it sets the key itself; rlhflow/config/params.py names the pairs (`Config.INHERITS`). Written back
(`Config.to_params`), a child holds only its own keys and those whose value differs from the parent's.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


S = TypeVar("S", bound=Section)


def inherited_keys(child: type[Section], parent: type[Section], own: frozenset[str] = frozenset()) -> list[str]:
    """The keys `child` takes from `parent` when it does not set them: the ones both have, except `own`."""
    return [k for k in child.model_fields if k in parent.model_fields and k not in own]


def inherit(child: S, parent: Section, own: frozenset[str] = frozenset()) -> S:
    """`child` with each inherited key it does not set itself (not in its `model_fields_set`) taken from `parent`.
    The keys it sets stay the only ones marked as set, so inheriting again from a changed parent follows it."""
    keys = inherited_keys(type(child), type(parent), own)
    taken = {k: copy.deepcopy(getattr(parent, k)) for k in keys if k not in child.model_fields_set}
    if all(getattr(child, k) == v for k, v in taken.items()):
        return child
    # values the parent validated, under the same field definitions (the child's class derives from the parent's)
    return type(child).model_construct(_fields_set=set(child.model_fields_set), **{**dict(child), **taken})


def without_inherited(child: dict[str, Any], parent: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """A child section's params without the inherited keys whose value is the parent's (re-read, it inherits them)."""
    return {k: v for k, v in child.items() if k not in keys or v != parent[k]}

"""A user's own code named in a setting as ``package.module:factory`` (``config.model``, ``config.dataset``).

Utility layer: standard library only.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def load_factory(setting: str, name: str, fix: str, error: type[Exception]) -> Callable[..., Any]:
  """The callable ``factory`` of ``name = "package.module:factory"``, imported.

  Args:
    setting: the setting that named it, for messages (e.g. ``"config.model"``).
    name: ``"package.module:factory"`` (both parts non-empty; the caller checks the form).
    fix: the sentence that tells the user what to give instead, appended to every message.
    error: the exception type raised (the caller's configuration error).

  Raises:
    error: the module cannot be imported (any exception of the user's module, named with its type), or it has no
      callable of that name.
  """
  module_name, _, attr = name.partition(":")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except  (user code: any import failure is a config error)
    raise error(f"{setting}={name!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}); {fix}") from None
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise error(f"{setting}={name!r}: module {module_name!r} has no callable {attr!r}; {fix}")
  return factory

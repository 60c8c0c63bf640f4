"""For `kopf run -m pagedinfer.operator.entrypoint`: registers the handlers on Kopf's default registry.

Configuration comes from the environment (`PAGEDINFER_OPERATOR_*`, see config.py). Importing
this module has that one side effect; everything else imports `handlers.register` instead.
"""

from __future__ import annotations

import kopf

from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.handlers import register

register(kopf.get_default_registry(), OperatorConfig.from_env())

"""The plots of bench/common.py under their old name, for the scripts that still import `plotting`
(throughput.py, throughput_lib.py, serving.py, vllm_compare.py, structured_output.py: in use by
other work while bench/ was tidied for issue 49); new code imports `common`. Delete this file when
none of them imports it.
"""

from common import save, subplots  # noqa: F401

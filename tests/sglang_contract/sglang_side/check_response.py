"""SGLang's own reading of a ``/generate`` answer (run by SGLang's interpreter): ``python check_response.py FILE``
with FILE a JSON answer. Prints one JSON line: the meta_info fields of SGLang's response schema
(``sglang.api.v1.api_types.GenerateMetaInfo``, what its servers write), whether the answer decodes by that schema
(``GenerateResponse.from_json_value``), and its routed experts as SGLang's own decoder reads them
(``extract_routed_experts_from_meta_info``: int32, flat)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import boot  # noqa: E402,F401 - before sglang

from sglang.api.v1.api_types import GenerateMetaInfo, GenerateResponse  # noqa: E402
from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info  # noqa: E402

answer = json.load(open(sys.argv[1]))
problem = None
try:
    GenerateResponse.from_json_value(answer)
except ValueError as e:
    problem = str(e)
routed = answer["meta_info"].get("routed_experts")
print(json.dumps({"schema_fields": sorted(GenerateMetaInfo.__struct_fields__), "schema_problem": problem,
                  "routed_experts": None if routed is None else extract_routed_experts_from_meta_info(answer).tolist()}))

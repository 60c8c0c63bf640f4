"""`python -m pagedinfer.engine.server.proto_gen`: generate the gRPC stubs now (setup.sh runs it)."""

import sys

from pagedinfer.engine.server import proto_gen

print(f"gRPC stubs in {proto_gen.ensure_stubs()}", file=sys.stderr)

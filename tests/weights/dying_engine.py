"""A fake engine for the connect-failure test: answers /server_info like a TP=1 engine, then dies (exit 3)
the moment it is asked to join the weight-sync group, without answering.

    python dying_engine.py        → prints "PORT\n" once it listens on 127.0.0.1
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _go(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        if self.path.startswith("/init_weights_update_group"):
            os._exit(3)  # dies mid-request: the client sees the connection close
        body = json.dumps({"tp_size": 1, "version": "dying-engine", "weight_sync_backends": ["gloo"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _go


if __name__ == "__main__":
    srv = HTTPServer(("127.0.0.1", 0), H)
    print(srv.server_address[1], flush=True)
    sys.stdout.close()
    srv.serve_forever()

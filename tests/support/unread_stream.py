"""HTTP streams a test opens and leaves unread, so that the server's send path fills and the
request pauses; read to their end later."""

from __future__ import annotations

import http.client
import json
import socket

CLIENT_RECEIVE_BUFFER = 4096


class SmallWindowConnection(http.client.HTTPConnection):
    """A connection whose socket takes in little before the server must wait for a read."""

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RECEIVE_BUFFER)
        self.sock.settimeout(self.timeout)
        self.sock.connect((self.host, self.port))


def open_unread_stream(
    port: int, body: dict, timeout_s: float
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion on `127.0.0.1:port` whose response headers are read, and nothing
    after them."""
    connection = SmallWindowConnection("127.0.0.1", port, timeout=timeout_s)
    payload = json.dumps(body)
    headers = {"Content-Type": "application/json"}
    connection.request("POST", "/v1/completions", body=payload, headers=headers)
    response = connection.getresponse()
    assert response.status == 200, response.read()
    return connection, response


def streamed_text(response: http.client.HTTPResponse) -> str:
    """The text of every event of a streamed completion, read to its `[DONE]`."""
    events = response.read().decode().split("\n\n")
    data = [event.removeprefix("data: ") for event in events if event.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return "".join(json.loads(chunk)["choices"][0]["text"] for chunk in data[:-1])

"""free_port picks below the OS's ephemeral range, where no port-0 bind or outgoing connection of
another process can take it before it is used."""
import socket

from dsrl.distributed.ports import ephemeral_start, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    top = ephemeral_start()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < top for p in ports) and len(ports) > 1
    for p in list(ports)[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_the_ephemeral_range_is_read_or_defaults(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ephemeral_start(str(f)) == 40000
    assert ephemeral_start(str(tmp_path / "missing")) == 32768

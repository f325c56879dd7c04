"""free_port: a port whose last server was killed (its connections in TIME_WAIT) is still handed
out, as the server itself can bind it; a port with a live listener is skipped."""
import socket

from mosaickv_sglang import launch


def _time_wait_port() -> int:
    """A port left in TIME_WAIT the way a killed server leaves it: the server side closes first."""
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = lst.accept()
    conn.close()  # active close on the server side: TIME_WAIT on (port, client port)
    cli.recv(1)
    cli.close()
    lst.close()
    return port


def test_a_port_in_time_wait_is_bindable_and_a_listening_one_is_not():
    port = _time_wait_port()
    with socket.socket() as plain:  # the old probe: refused, though a server could bind it
        try:
            plain.bind(("127.0.0.1", port))
            plain_ok = True
        except OSError:
            plain_ok = False
    assert not plain_ok, "the stand-in did not leave the port in TIME_WAIT"
    assert launch._bindable(port)
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        assert not launch._bindable(lst.getsockname()[1])


def test_free_port_skips_a_port_held_by_another_process_within_its_span(monkeypatch):
    monkeypatch.setattr(launch, "_ports_given", set())
    first = launch.free_port()
    launch.release_port(first)
    with socket.socket() as lst:  # someone else listens on the port this process would take
        lst.bind(("127.0.0.1", first))
        lst.listen(1)
        again = launch.free_port()
    launch.release_port(again)
    assert again != first
    assert again - again % launch.PORT_SPAN == first - first % launch.PORT_SPAN  # same span

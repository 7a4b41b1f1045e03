"""``edgepack serve``: the MQTT agent (agent.py, conn.py, sched.py, store.py, blobs.py,
metrics.py, cli.py) and the job protocol and payload codec it shares with the client
(protocol.py, codec.py). The device runtime core (bundle, executor, session, device)
never imports this package; only the ``serve`` command and the client do."""

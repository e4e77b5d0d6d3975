"""The Flower runtime: every fedfm algorithm as a Flower ServerApp + ClientApp.

The server half of an algorithm runs inside Flower's ``ServerApp`` through the fedfm engine;
the client half inside Flower's ``ClientApp`` through the same client call path as the
embedded runtime, so a run gives the same metrics on every runtime with the same seed. One
module per concern:

- :mod:`~fedfm.runtime.flower.options`: the runtime's options, plugins and environment;
- :mod:`~fedfm.runtime.flower.payload`: the run payload and the runtime's run-folder files
  (no torch, no Flower: the commands import it);
- :mod:`~fedfm.runtime.flower.wire`: the wire format (fedfm messages as Flower records);
- :mod:`~fedfm.runtime.flower.server`: the federation over Flower's grid and the server
  session (the ServerApp's body);
- :mod:`~fedfm.runtime.flower.client`: the ClientApp's body (client state, snapshots);
- :mod:`~fedfm.runtime.flower.simulation`: runs on Flower's simulation engine;
- :mod:`~fedfm.runtime.flower.tls`: certificates and node keys;
- :mod:`~fedfm.runtime.flower.processes`: starting, watching and stopping Flower processes;
- :mod:`~fedfm.runtime.flower.deploy`: the deployment engine's server side (``fedfm serve``:
  SuperLink, node keys, runs);
- :mod:`~fedfm.runtime.flower.deploy_client`: its client side (``fedfm client``: SuperNodes
  and their warm workers);
- :mod:`~fedfm.runtime.flower.commands`: the ``fedfm serve|client|flower-app|flower-certs``
  commands.

The Flower app objects themselves (``server_app``, ``client_app``) and the warm ClientApp
worker live in :mod:`fedfm.runtime.flower_app`, the name Flower app configs refer to.
"""

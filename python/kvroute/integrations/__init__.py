"""Adapters that embed kvroute in other projects' routers (each one an optional extra).

- kvroute.integrations.ray: `KvrouteRequestRouter`, a Ray Serve RequestRouter
  (`pip install kvroute[ray]`). Its Ray-free parts: ray_keys (request -> routing key),
  ray_core (the lifecycle bookkeeping), ray_engine (a simulated-engine replica for tests).
"""

"""The gateway: the public Generation and Models API. Stateless; any replica serves any request."""

"""The app composed from settings: the FastAPI app and its lifespan, the stock server's plugin hook, the
start-up of the models, the shutdown. The top of the server: nothing in it imports this."""

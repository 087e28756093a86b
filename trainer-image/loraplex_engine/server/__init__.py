"""The engine's HTTP server: the app, its errors and middleware, `serve` and its flags."""

"""Operations: metrics, the API key and body limits, connection limits, the shutdown's cut of
requests in flight."""

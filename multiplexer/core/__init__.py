"""The call path: the contracts and parts every face and provider share; imports no face or provider."""

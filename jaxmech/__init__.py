"""jaxmech"""

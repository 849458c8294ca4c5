"""vLLM's HTTPS flags for `kiln serve`: --ssl-keyfile, --ssl-certfile, --ssl-ca-certs and
--ssl-cert-reqs, handed to uvicorn as vLLM hands them. The files are loaded once before the
model loads, so a wrong path or a key that does not match its certificate is said at once,
naming the flag, rather than by uvicorn's traceback after minutes of start-up."""
import ssl

from kiln.entrypoints.openai.server_settings import ServerSettings


def check_tls_flags(keyfile: str | None, certfile: str | None, ca_certs: str | None,
                    cert_reqs: int) -> None:
    """ValueError naming the flag when these cannot make an HTTPS server."""
    if cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), "
                         f"got {cert_reqs}")
    if certfile is None:
        for flag, value in (("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs)):
            if value is not None:
                raise ValueError(f"{flag} needs --ssl-certfile (the server's certificate)")
        if cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-cert-reqs needs --ssl-certfile (HTTPS)")
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        flags = "--ssl-certfile" + (" / --ssl-keyfile" if keyfile else "")
        hint = "" if keyfile else " (its key too, unless --ssl-keyfile names it)"
        raise ValueError(f"{flags}: cannot load the certificate{hint}: {e}") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs: cannot load {ca_certs}: {e}") from None


def uvicorn_tls_config(settings: ServerSettings) -> dict:
    """uvicorn.Config's TLS arguments for `settings` (none: plain HTTP)."""
    if settings.ssl_certfile is None:
        return {}
    return dict(ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile,
                ssl_ca_certs=settings.ssl_ca_certs, ssl_cert_reqs=settings.ssl_cert_reqs)

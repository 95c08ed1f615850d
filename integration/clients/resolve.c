/* Resolves each name on the command line with the C library's getaddrinfo (AF_UNSPEC,
 * SOCK_STREAM), as an application in a pod does, and prints one line per address:
 *
 *     NAME ADDRESS
 *
 * A name that does not resolve prints "NAME error: <gai_strerror>" instead. The exit status is
 * 0 when every name resolved, 2 when the last failure was EAI_NONAME (the name does not exist),
 * 1 for any other failure.
 *
 * Built static against musl by the resolver tests (musl-gcc -static), so the resolver under
 * test is musl's own, whatever the machine's C library is. */
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

int main(int argc, char **argv) {
    int status = 0;
    for (int i = 1; i < argc; i++) {
        struct addrinfo hints, *res, *ai;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        int err = getaddrinfo(argv[i], NULL, &hints, &res);
        if (err != 0) {
            printf("%s error: %s\n", argv[i], gai_strerror(err));
            status = err == EAI_NONAME ? 2 : 1;
            continue;
        }
        for (ai = res; ai != NULL; ai = ai->ai_next) {
            char text[INET6_ADDRSTRLEN];
            const void *addr = ai->ai_family == AF_INET6
                ? (const void *)&((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr
                : (const void *)&((struct sockaddr_in *)ai->ai_addr)->sin_addr;
            if (inet_ntop(ai->ai_family, addr, text, sizeof text) != NULL) {
                printf("%s %s\n", argv[i], text);
            }
        }
        freeaddrinfo(res);
    }
    return status;
}

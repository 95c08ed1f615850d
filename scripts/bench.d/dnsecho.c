/* The echo ceiling of scripts/bench: the least work a UDP DNS server can do per query.
 *
 *     dnsecho ADDR PORT THREADS
 *
 * Each thread owns a SO_REUSEPORT socket, takes up to BATCH datagrams per recvmmsg(2), turns
 * each one into a reply in place (QR and RA set, AA/TC cleared, RCODE 0, the question echoed,
 * no records) and returns the batch with sendmmsg(2). No parsing, no cache, no allocation: what
 * is left is the kernel's UDP path and the syscalls, which any real server pays too.
 * Compiled by scripts/bench at run time (gcc -O2 -pthread).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

enum { BATCH = 32, MAXMSG = 1500, MAXTHREADS = 64 };

static struct sockaddr_in listen_on;

static int open_socket(void)
{
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    int on = 1, buf = 8 << 20;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &on, sizeof on) != 0) {
        perror("dnsecho: socket");
        exit(1);
    }
    /* Large buffers so a burst from a closed-loop client is not dropped before we run. */
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    if (bind(fd, (struct sockaddr *)&listen_on, sizeof listen_on) != 0) {
        perror("dnsecho: bind");
        exit(1);
    }
    return fd;
}

static void *serve(void *unused)
{
    (void)unused;
    int fd = open_socket();
    static __thread unsigned char data[BATCH][MAXMSG];
    struct sockaddr_in from[BATCH];
    struct iovec iov[BATCH];
    struct mmsghdr msg[BATCH];

    for (;;) {
        memset(msg, 0, sizeof msg);
        for (int i = 0; i < BATCH; i++) {
            iov[i] = (struct iovec){ .iov_base = data[i], .iov_len = MAXMSG };
            msg[i].msg_hdr.msg_name = &from[i];
            msg[i].msg_hdr.msg_namelen = sizeof from[i];
            msg[i].msg_hdr.msg_iov = &iov[i];
            msg[i].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(fd, msg, BATCH, MSG_WAITFORONE, NULL);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            perror("dnsecho: recvmmsg");
            exit(1);
        }
        for (int i = 0; i < got; i++) {
            unsigned char *h = data[i];
            if (msg[i].msg_len >= 12) {
                h[2] = (unsigned char)(0x80 | (h[2] & 0x79)); /* QR, opcode and RD kept */
                h[3] = 0x80;                                  /* RA, RCODE NOERROR */
            }
            iov[i].iov_len = msg[i].msg_len;
        }
        for (int sent = 0; sent < got;) {
            int n = sendmmsg(fd, msg + sent, (unsigned)(got - sent), 0);
            if (n <= 0)
                break; /* a full socket buffer drops the rest, as a busy server would */
            sent += n;
        }
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: dnsecho ADDR PORT THREADS\n");
        return 64;
    }
    listen_on.sin_family = AF_INET;
    listen_on.sin_port = htons((unsigned short)atoi(argv[2]));
    if (inet_pton(AF_INET, argv[1], &listen_on.sin_addr) != 1) {
        fprintf(stderr, "dnsecho: not an IPv4 address: %s\n", argv[1]);
        return 64;
    }
    int threads = atoi(argv[3]);
    threads = threads < 1 ? 1 : threads > MAXTHREADS ? MAXTHREADS : threads;
    pthread_t tid[MAXTHREADS];
    for (int i = 0; i < threads; i++)
        pthread_create(&tid[i], NULL, serve, NULL);
    for (int i = 0; i < threads; i++)
        pthread_join(tid[i], NULL);
    return 0;
}

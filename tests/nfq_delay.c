/* The lab's packet delayer: holds every packet of one netfilter queue for a fixed delay.
 *
 *     nfq_delay QUEUE DELAY_US [MAXLEN]
 *
 * tests/netns.py compiles it with the machine's C compiler and runs it in a lab's switch
 * namespace, where an iptables rule (FORWARD -j NFQUEUE --queue-num QUEUE, no bypass) hands
 * it every IPv4 packet crossing the switch. It speaks nfnetlink to the kernel directly (no
 * libnetfilter_queue): it binds the queue in copy-meta mode (the kernel keeps the packet and
 * sends only its id and metadata), whole GSO packets (no segmentation for the queue), a
 * queue of MAXLEN packets (default 262144) and a large netlink receive buffer, fail-open off
 * (a full queue drops, never lets a packet skip the delay). Every packet is released
 * (NF_ACCEPT) DELAY_US after it entered the switch: the kernel's receive timestamp of the
 * packet where it has one (this program opens a socket with SO_TIMESTAMPNS so the kernel
 * stamps packets as they arrive), else the time this program read it. One delay for all, so
 * the held packets are a FIFO and a release is one batch verdict (every id up to the last
 * due), which the kernel applies in arrival order.
 *
 * It asks for real-time scheduling (SCHED_FIFO, priority 1) so that a release is not late
 * when the machine is busy, and runs as any process where it may not.
 *
 * It prints "ready" once the queue is bound, then runs until a signal; on SIGTERM or SIGINT
 * it prints one line of counters to stderr (packets, batch verdicts, the most held at once,
 * the largest lateness of a release in microseconds, packets without a kernel timestamp)
 * and exits 0. Exit status 1 with a message on stderr when the kernel refuses the queue.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 256           /* messages read per recvmmsg */
#define MSG_BYTES 1024      /* a copy-meta packet message is ~200 bytes */

struct held { uint32_t id; int64_t due_us; };

static volatile sig_atomic_t stopping;
static void on_signal(int sig) { (void)sig; stopping = 1; }

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void die(const char *what) {
    fprintf(stderr, "nfq_delay: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* Appends attribute (type, data, len) to the message in buf; returns the new length. */
static size_t put_attr(char *buf, size_t len, uint16_t type, const void *data, uint16_t size) {
    struct nlattr *a = (struct nlattr *)(buf + NLMSG_ALIGN(len));
    a->nla_type = type;
    a->nla_len = (uint16_t)(NLA_HDRLEN + size);
    memcpy((char *)a + NLA_HDRLEN, data, size);
    return NLMSG_ALIGN(len) + NLA_ALIGN(a->nla_len);
}

/* Starts an nfnetlink queue message of type msg for queue in buf; returns its length. */
static size_t start(char *buf, uint16_t msg, uint16_t flags, uint16_t queue) {
    struct nlmsghdr *h = (struct nlmsghdr *)buf;
    memset(buf, 0, NLMSG_HDRLEN + sizeof(struct nfgenmsg));
    h->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | msg;
    h->nlmsg_flags = NLM_F_REQUEST | flags;
    struct nfgenmsg *g = (struct nfgenmsg *)NLMSG_DATA(h);
    g->nfgen_family = AF_UNSPEC;
    g->version = NFNETLINK_V0;
    g->res_id = htons(queue);
    return NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(struct nfgenmsg));
}

static void send_msg(int fd, char *buf, size_t len) {
    ((struct nlmsghdr *)buf)->nlmsg_len = (uint32_t)len;
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    while (sendto(fd, buf, len, 0, (struct sockaddr *)&kernel, sizeof kernel) < 0) {
        if (errno != EINTR) die("sendto");
    }
}

/* Sends a config message with NLM_F_ACK and waits for the kernel's answer. */
static void configure(int fd, char *buf, size_t len, const char *what) {
    static uint32_t seq;
    ((struct nlmsghdr *)buf)->nlmsg_seq = ++seq;
    send_msg(fd, buf, len);
    char answer[4096];
    for (;;) {
        ssize_t n = recv(fd, answer, sizeof answer, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            die(what);
        }
        for (struct nlmsghdr *h = (struct nlmsghdr *)answer; NLMSG_OK(h, (size_t)n);
             h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type != NLMSG_ERROR || h->nlmsg_seq != seq) continue;
            int err = ((struct nlmsgerr *)NLMSG_DATA(h))->error;
            if (err == 0) return;
            errno = -err;
            die(what);
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: nfq_delay QUEUE DELAY_US [MAXLEN]\n");
        return 2;
    }
    uint16_t queue = (uint16_t)atoi(argv[1]);
    int64_t delay_us = atoll(argv[2]);
    uint32_t maxlen = argc > 3 ? (uint32_t)strtoul(argv[3], NULL, 10) : 262144;
    size_t capacity = (size_t)maxlen + 1;
    struct held *ring = calloc(capacity, sizeof *ring);
    if (ring == NULL) die("calloc");

    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    prctl(PR_SET_TIMERSLACK, 1000UL);  /* wake within a microsecond of the due time */
    /* Ahead of the machine's other work where allowed (a cable's delay does not grow with
     * the load of the hosts at its ends); as any process where not. */
    struct sched_param rt = {.sched_priority = 1};
    sched_setscheduler(0, SCHED_FIFO, &rt);

    /* Any socket asking for receive timestamps makes the kernel stamp every packet as it
     * arrives (netif_rx), and the queue's messages then carry the stamp. */
    int stamp = socket(AF_INET, SOCK_DGRAM, 0);
    int one = 1;
    if (stamp < 0 || setsockopt(stamp, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one) < 0)
        die("SO_TIMESTAMPNS");

    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
    if (fd < 0) die("netlink socket");
    int rcvbuf = 64 << 20;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf) < 0
        && setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf) < 0)
        die("SO_RCVBUF");
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sockaddr_nl me = {.nl_family = AF_NETLINK};
    if (bind(fd, (struct sockaddr *)&me, sizeof me) < 0) die("bind");

    char buf[256];
    size_t len = start(buf, NFQNL_MSG_CONFIG, NLM_F_ACK, queue);
    struct nfqnl_msg_config_cmd bind_cmd = {.command = NFQNL_CFG_CMD_BIND,
                                            .pf = htons(AF_INET)};
    len = put_attr(buf, len, NFQA_CFG_CMD, &bind_cmd, sizeof bind_cmd);
    configure(fd, buf, len, "bind the queue (is another program bound to it?)");

    len = start(buf, NFQNL_MSG_CONFIG, NLM_F_ACK, queue);
    struct nfqnl_msg_config_params params = {.copy_range = 0, .copy_mode = NFQNL_COPY_META};
    len = put_attr(buf, len, NFQA_CFG_PARAMS, &params, sizeof params);
    uint32_t qmax = htonl(maxlen);
    len = put_attr(buf, len, NFQA_CFG_QUEUE_MAXLEN, &qmax, sizeof qmax);
    uint32_t mask = htonl(NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN);
    uint32_t flags = htonl(NFQA_CFG_F_GSO);
    len = put_attr(buf, len, NFQA_CFG_MASK, &mask, sizeof mask);
    len = put_attr(buf, len, NFQA_CFG_FLAGS, &flags, sizeof flags);
    configure(fd, buf, len, "configure the queue");

    printf("ready\n");
    fflush(stdout);

    static char space[BATCH][MSG_BYTES];
    struct iovec iov[BATCH];
    struct mmsghdr msgs[BATCH];
    for (int i = 0; i < BATCH; i++) {
        iov[i].iov_base = space[i];
        iov[i].iov_len = MSG_BYTES;
    }
    size_t head = 0, tail = 0, most = 0;
    uint64_t packets = 0, verdicts = 0, unstamped = 0;
    int64_t latest = 0;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};

    while (!stopping) {
        /* Release the prefix that is due: one batch verdict up to its last id. */
        int64_t now = now_us();
        if (head != tail && ring[head].due_us <= now) {
            uint32_t last = 0;
            while (head != tail && ring[head].due_us <= now) {
                if (now - ring[head].due_us > latest) latest = now - ring[head].due_us;
                last = ring[head].id;
                head = (head + 1) % capacity;
            }
            len = start(buf, NFQNL_MSG_VERDICT_BATCH, 0, queue);
            struct nfqnl_msg_verdict_hdr verdict = {.verdict = htonl(NF_ACCEPT),
                                                    .id = htonl(last)};
            len = put_attr(buf, len, NFQA_VERDICT_HDR, &verdict, sizeof verdict);
            send_msg(fd, buf, len);
            verdicts++;
            continue;
        }
        struct timespec wait, *timeout = NULL;
        if (head != tail) {
            int64_t us = ring[head].due_us - now;
            wait.tv_sec = us / 1000000;
            wait.tv_nsec = (us % 1000000) * 1000;
            timeout = &wait;
        }
        int ready = ppoll(&pfd, 1, timeout, NULL);
        if (ready < 0 && errno != EINTR) die("ppoll");
        if (ready <= 0) continue;
        for (;;) {
            for (int i = 0; i < BATCH; i++) {
                memset(&msgs[i].msg_hdr, 0, sizeof msgs[i].msg_hdr);
                msgs[i].msg_hdr.msg_iov = &iov[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
            }
            int got = recvmmsg(fd, msgs, BATCH, MSG_DONTWAIT, NULL);
            if (got < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK) break;
                if (errno == EINTR || errno == ENOBUFS) continue;
                die("recvmmsg");
            }
            int64_t read_at = now_us();
            for (int i = 0; i < got; i++) {
                int n = (int)msgs[i].msg_len;
                for (struct nlmsghdr *h = (struct nlmsghdr *)space[i]; NLMSG_OK(h, (unsigned)n);
                     h = NLMSG_NEXT(h, n)) {
                    if (h->nlmsg_type != ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET)) continue;
                    int64_t arrived = 0;
                    uint32_t id = 0;
                    int have_id = 0;
                    char *at = (char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg));
                    char *end = (char *)h + h->nlmsg_len;
                    while (at + NLA_HDRLEN <= end) {
                        struct nlattr *a = (struct nlattr *)at;
                        if (a->nla_len < NLA_HDRLEN || at + a->nla_len > end) break;
                        int type = a->nla_type & NLA_TYPE_MASK;
                        void *value = at + NLA_HDRLEN;
                        if (type == NFQA_PACKET_HDR) {
                            id = ntohl(((struct nfqnl_msg_packet_hdr *)value)->packet_id);
                            have_id = 1;
                        } else if (type == NFQA_TIMESTAMP) {
                            struct nfqnl_msg_packet_timestamp *t = value;
                            arrived = (int64_t)be64toh(t->sec) * 1000000
                                      + (int64_t)be64toh(t->usec);
                        }
                        at += NLA_ALIGN(a->nla_len);
                    }
                    if (!have_id) continue;
                    /* A stamp from the future or a second old is a clock step: use now. */
                    if (arrived <= read_at - 1000000 || arrived > read_at) {
                        arrived = read_at;
                        unstamped++;
                    }
                    ring[tail].id = id;
                    ring[tail].due_us = arrived + delay_us;
                    tail = (tail + 1) % capacity;
                    if (tail == head) {  /* cannot happen: the kernel holds at most MAXLEN */
                        fprintf(stderr, "nfq_delay: more than %u packets held\n", maxlen);
                        return 1;
                    }
                    packets++;
                    size_t holding = (tail + capacity - head) % capacity;
                    if (holding > most) most = holding;
                }
            }
            if (got < BATCH) break;
        }
    }
    fprintf(stderr, "nfq_delay: packets %llu verdicts %llu most_held %zu latest_us %lld "
            "unstamped %llu\n", (unsigned long long)packets, (unsigned long long)verdicts,
            most, (long long)latest, (unsigned long long)unstamped);
    return 0;
}

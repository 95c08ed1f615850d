// Resolves each name on the command line with Go's own resolver (net.Resolver with PreferGo,
// which reads /etc/resolv.conf itself), as a Go program in a pod does, and prints one line
// per address:
//
//	NAME ADDRESS
//
// A name that does not resolve prints "NAME error: <error>" instead. The exit status is 0 when
// every name resolved, 2 when the last failure was "no such host", 1 for any other failure.
//
// Built by the resolver tests with CGO_ENABLED=0 (a static binary, no C library involved) and
// only the standard library, so it builds offline.
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"
)

func main() {
	resolver := &net.Resolver{PreferGo: true}
	status := 0
	for _, name := range os.Args[1:] {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		addrs, err := resolver.LookupHost(ctx, name)
		cancel()
		if err != nil {
			fmt.Printf("%s error: %v\n", name, err)
			var dnsErr *net.DNSError
			if errors.As(err, &dnsErr) && dnsErr.IsNotFound {
				status = 2
			} else {
				status = 1
			}
			continue
		}
		for _, addr := range addrs {
			fmt.Printf("%s %s\n", name, addr)
		}
	}
	os.Exit(status)
}

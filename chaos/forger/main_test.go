package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"math/big"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/fsm"
)

// answerRPCs serves a real hashicorp/raft transport on l and answers every RPC it decodes,
// recording the forged AppendEntries.
func answerRPCs(t *testing.T, l net.Listener) (*raft.NetworkTransport, chan *raft.AppendEntriesRequest) {
	t.Helper()
	tr := raft.NewNetworkTransport(&listenerStream{l}, 2, time.Second, nil)
	t.Cleanup(func() { tr.Close() })
	got := make(chan *raft.AppendEntriesRequest, 100)
	go func() {
		for rpc := range tr.Consumer() {
			switch cmd := rpc.Command.(type) {
			case *raft.AppendEntriesRequest:
				select {
				case got <- cmd:
				default:
				}
				rpc.Respond(&raft.AppendEntriesResponse{}, nil)
			case *raft.RequestVoteRequest:
				rpc.Respond(&raft.RequestVoteResponse{}, nil)
			case *raft.TimeoutNowRequest:
				rpc.Respond(&raft.TimeoutNowResponse{}, nil)
			default:
				rpc.Respond(nil, nil)
			}
		}
	}()
	return tr, got
}

type listenerStream struct{ net.Listener }

func (s *listenerStream) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	return net.DialTimeout("tcp", string(address), timeout)
}

func newForger(t *testing.T, raftAddr string) *forger {
	t.Helper()
	lj, err := forgedLimits("")
	if err != nil {
		t.Fatal(err)
	}
	return &forger{raft: []string{raftAddr}, limitsJSON: lj, pace: time.Millisecond, rep: Report{Vectors: map[string]*Vector{}}}
}

// The forger's RPCs are well formed: a plain Raft transport decodes and answers them (an
// insecure cluster would act on them), and the AppendEntries carry a decodable SetLimits
// command stamped far ahead and a garbage entry.
func TestForgedRaftRPCsReachAPlainTransport(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, got := answerRPCs(t, l)
	f := newForger(t, l.Addr().String())
	f.run(300 * time.Millisecond)
	v := f.rep.Vectors["raft-plain"]
	if v == nil || v.Accepted == 0 {
		t.Fatalf("raft-plain = %+v: a plain transport answered nothing", v)
	}
	if v := f.rep.Vectors["raft-tls-nocert"]; v.Accepted != 0 || v.Refused == 0 {
		t.Fatalf("raft-tls-nocert against a plain port = %+v, want refused", v)
	}
	if v := f.rep.Vectors["raft-tls-client"]; v.Skipped == "" {
		t.Fatalf("raft-tls-client without a certificate = %+v, want skipped", v)
	}
	ae := <-got
	if len(ae.Entries) != 2 {
		t.Fatalf("forged AppendEntries has %d entries, want 2", len(ae.Entries))
	}
	var cmd fsmv1.Command
	err = proto.Unmarshal(ae.Entries[0].Data, &cmd)
	if err != nil || cmd.Version != fsm.CommandVersion || len(cmd.Ops) != 1 || cmd.Ops[0].GetSetLimits() == nil {
		t.Fatalf("first forged entry is not a SetLimits command: %v %v", &cmd, err)
	}
	if ahead := time.Until(time.Unix(0, cmd.Ts)); ahead < 50*365*24*time.Hour {
		t.Fatalf("forged command stamped %v ahead, want decades", ahead)
	}
	var lim map[string]any
	if err := json.Unmarshal(cmd.Ops[0].GetSetLimits().LimitsJson, &lim); err != nil {
		t.Fatalf("forged limits are not JSON: %v", err)
	}
}

// Behind a TLS listener that requires a client certificate from its CA, no vector gets an
// answer — including the one with a certificate from another CA.
func TestForgedRaftRPCsRefusedByMutualTLS(t *testing.T) {
	serverCert, _ := selfSigned(t, "server")
	otherCert, _ := selfSigned(t, "client")
	caPool := x509.NewCertPool()
	caPool.AddCert(serverCert.Leaf)
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := tls.NewListener(raw, &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: caPool})
	answerRPCs(t, l)
	f := newForger(t, raw.Addr().String())
	f.clientCert = &otherCert
	f.run(300 * time.Millisecond)
	for name, v := range f.rep.Vectors {
		if v.Accepted != 0 || v.Refused == 0 {
			t.Errorf("%s = %+v: want every attempt refused", name, v)
		}
	}
	if len(f.rep.Vectors) != 4 {
		t.Fatalf("vectors %v, want the 4 Raft ones", f.rep.Vectors)
	}
}

func selfSigned(t *testing.T, cn string) (tls.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, key
}
